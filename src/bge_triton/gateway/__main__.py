"""`bge-triton gateway`: run the gateway on uvicorn."""
from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from bge_triton.errors import KitError

__all__ = ["main"]

log = logging.getLogger("bge_triton.gateway")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags into one GatewaySettings, build the app and serve it until SIGINT / SIGTERM."""
    from bge_triton import flags
    from bge_triton.gateway import build_parser, create_app, settings_from_args

    args = flags.parse(build_parser(), argv)
    try:
        settings = settings_from_args(args)
        app = create_app(settings)
    except KitError as exc:
        print(f"bge-triton gateway: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if settings.api_keys:
        log.info("%d API key(s) configured: every /v1 and /embed request needs Authorization: Bearer",
                 len(settings.api_keys))
    else:
        log.warning("no API key configured: serving %s:%d without authentication%s", settings.host, settings.port,
                    "" if not settings.unsafe_no_auth else " (--unsafe-no-auth: publish this port on 127.0.0.1 only)")
    log.info("gateway -> Triton %s model %s; OpenAI base_url http://%s:%d/v1", settings.triton, settings.model,
             settings.host, settings.port)
    if settings.reference:
        log.info("/ready stays 503 until %s reproduces the reference vectors of %s", settings.model, settings.reference)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False,
                loop="auto", http="auto", timeout_graceful_shutdown=5,  # uvloop + httptools where installed
                timeout_keep_alive=settings.keep_alive_s)  # type: ignore[arg-type]  # uvicorn takes seconds as float
    return 0


if __name__ == "__main__":
    sys.exit(main())
