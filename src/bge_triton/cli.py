"""`bge-triton <command>`: one console script for the commands users type; each is also `python -m ...`."""
from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# command -> (module with main(argv), or module:function, what it does). The benchmark commands are one tree
# (loadtest.commands); the others also run as `python -m <module>`.
# The SDK's CLI has sub-commands of its own: `bge-triton embed X` is `python -m bge_triton.client embed X`.
SUBCOMMAND = {"embed": "embed", "health": "health"}
COMMANDS = {
    "export": ("bge_triton.export.__main__", "HF model -> validated ONNX in the model repository [export]"),
    "serve": ("bge_triton.server.__main__", "the local tritonserver: up | status | down [server]"),
    "verify": ("bge_triton.verify.__main__", "a running server's vectors against the export's reference vectors"),
    "embed": ("bge_triton.client.cli", "embed TEXT... through a running server (the SDK)"),
    "health": ("bge_triton.client.cli", "server and model readiness plus a canary embedding (the SDK)"),
    "demo": ("bge_triton.demo", "export, serve, embed, stop: the whole kit once [all]"),
    "bench": ("bge_triton.loadtest.commands:bench_main", "bench <scenario>: seed, shipped, stack, gateway, soak, "
              "client, ... (`bge-triton bench --help` lists them) [loadtest, server]"),
    "tune": ("bge_triton.loadtest.commands:tune_main", "tune [pair]: the queue delay, or the encoder and text "
             "endpoint together [loadtest, server]"),
    "chaos": ("bge_triton.loadtest.commands:chaos_main", "bad input, overload and faults [loadtest, server]"),
    "gateway": ("bge_triton.gateway.__main__", "OpenAI-compatible /v1/embeddings in front of Triton [gateway]"),
}


def usage() -> str:
    rows = "\n".join(f"  {name:<8} {what}" for name, (_, what) in COMMANDS.items())
    return ("usage: bge-triton <command> [args...]   (bge-triton <command> --help for its flags)\n\n"
            f"commands ([extra] = pip install 'bge-triton-kit[extra]'):\n{rows}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to the command's own main(argv); 2 with the usage for an unknown command."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"bge-triton: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    try:
        target, _, function = COMMANDS[name][0].partition(":")
        module = importlib.import_module(target)
    except ImportError as exc:
        print(f"bge-triton {name}: {exc}", file=sys.stderr)
        return 1
    if name in SUBCOMMAND:
        rest = [SUBCOMMAND[name], *rest]
    return int(getattr(module, function or "main")(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
