"""`bge-triton <command>`: the one program users type; each command parses its own flags (`--help`)."""
from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from bge_triton import flags
from bge_triton.loadtest.commands import BENCH, TUNE

# `bge-triton embed X` is the SDK's CLI with its sub-command put in front: `embed X`
SUBCOMMAND = {"embed": "embed", "health": "health"}
# command -> (module with main(argv), or module:function; what it does [the extra it needs])
COMMANDS = {
    "export": ("bge_triton.export.__main__", "a hub model (downloaded), a local dir or synthetic:... -> validated "
               "ONNX in the model repository [export]"),
    "serve": ("bge_triton.server.__main__", "the local tritonserver on this machine: up | status | down [server]"),
    "verify": ("bge_triton.verify.__main__", "a running server's vectors against the export's reference vectors"),
    "embed": ("bge_triton.client.cli", "embed TEXT... through a running server (the SDK)"),
    "health": ("bge_triton.client.cli", "server and model readiness plus a canary embedding (the SDK)"),
    "gateway": ("bge_triton.gateway.__main__", "OpenAI-compatible /v1/embeddings in front of Triton [gateway]"),
    "demo": ("bge_triton.demo", "export, serve, embed, stop: the whole kit once on this machine [all]"),
    "bench": ("bge_triton.loadtest.commands:bench_main", f"bench <scenario>: {', '.join(BENCH)} "
              "[loadtest; server too without --url]"),
    "tune": ("bge_triton.loadtest.commands:tune_main", f"tune [{' | '.join(TUNE)}]: the batching settings of a "
             "running server [loadtest; server too without --url]"),
    "chaos": ("bge_triton.loadtest.commands:chaos_main", "bad input, overload and faults [loadtest, server]"),
}


def usage() -> str:
    rows = "\n".join(f"  {name:<8} {what}" for name, (_, what) in COMMANDS.items())
    return (f"usage: bge-triton <command> [flags]   (bge-triton <command> --help for its flags)\n"
            f"       bge-triton --version\n\n"
            f"commands ([extra] = pip install 'bge-triton-kit[extra]'):\n{rows}\n\n"
            f"Every flag also reads an environment variable: --model-id is {flags.env_name('--model-id')}.\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to the command's own main(argv); 2 with the usage for an unknown command."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if args else 2
    if args[0] == "--version":
        print(f"bge-triton {flags.version()}")
        return 0
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
