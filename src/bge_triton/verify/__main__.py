"""Embed the export's probe texts through a running server and hold them to the reference.

Exit 0 verified, 1 below the tolerance (the message names model, precision, worst probe, cosine, and the
tokenizer when the text endpoint alone is off), 2 when the check could not run (no server, no reference).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from bge_triton import flags
from bge_triton.errors import InputError

from . import DEFAULT_REPOSITORY
from .standalone import CANNOT_CHECK, FAILED, OK, VerifyError, load_reference, resolve_reference, run_check
from .triton import TritonTransport


def build_parser() -> argparse.ArgumentParser:
    p = flags.parser("bge-triton verify", __doc__ or "")
    flags.add_url(p)
    flags.add_model(p, help="the served model's name (the text endpoint); its encoder is read from the server's "
                    "config (parameter onnx_model)")
    p.add_argument("--reference", type=Path, default=None, metavar="PATH", help="the export's reference.json "
                   "(default: REPOSITORY/<encoder>/1/reference.json)")
    p.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY, metavar="DIR",
                   help="the exported model repository (the one compose mounts)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS", help="seconds per request")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the result as JSON here")
    return p


def _rerank_main(a: argparse.Namespace, reference: Path) -> int:
    """A reranker's reference (format bge-triton-rerank-reference/1): its pairs through the served reranker."""
    from .rerank_standalone import check
    url = flags.server_url(a.url)
    if url.protocol != "http":
        print(f"verify could not run: a reranker is checked over HTTP; pass --url http://HOST:8000 (got {a.url})",
              file=sys.stderr)
        return CANNOT_CHECK
    code, message = check(url.address, a.model, reference, None, a.timeout)
    print(message, file=sys.stdout if code == OK else sys.stderr)
    return code


def _is_rerank(path: Path) -> bool:
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("task") == "rerank"
    except (OSError, ValueError):
        return False


def main(argv: Sequence[str] | None = None) -> int:
    a = flags.parse(build_parser(), argv)
    try:
        url = flags.server_url(a.url)
        with TritonTransport(url.address, url.protocol, a.timeout) as transport:
            path = resolve_reference(transport, a.model, a.repository, a.reference)
    except (VerifyError, InputError) as err:
        print(f"verify could not run: {err}", file=sys.stderr)
        return CANNOT_CHECK
    if _is_rerank(path):
        return _rerank_main(a, path)
    try:
        with TritonTransport(url.address, url.protocol, a.timeout) as transport:
            ref = load_reference(resolve_reference(transport, a.model, a.repository, a.reference))
            result = run_check(transport, a.model, ref)
    except (VerifyError, InputError) as err:
        print(f"verify could not run: {err}", file=sys.stderr)
        return CANNOT_CHECK
    print(f"{len(ref.probes)} probes of {ref.path} ({ref.source}, {ref.precision}); cosine against PyTorch FP32:")
    print(result.table())
    print(result.message, file=sys.stdout if result.ok else sys.stderr)
    if a.json:
        a.json.write_text(json.dumps(result.to_dict(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return OK if result.ok else FAILED


if __name__ == "__main__":
    sys.exit(main())
