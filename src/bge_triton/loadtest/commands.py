"""The benchmark command tree: `bge-triton bench <scenario>`, `bge-triton tune [pair]`, `bge-triton chaos`; these
tables are the one place that names the scenarios (modules with main(argv)). The other entry points: Locust
(`locust -f src/bge_triton/loadtest/locustfile.py`) and the GPU host's `bash src/bge_triton/loadtest/gpu/run.sh`."""
from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping, Sequence

# scenario -> (module in bge_triton.loadtest, its main(argv) function, what it measures)
BENCH: dict[str, tuple[str, str, str]] = {
    "seed": ("bench", "main",
             "the seed table: batch 1, static 32, dynamic 5 ms, delay 0, text endpoint (--url: a running Triton)"),
    "shipped": ("shipped", "main", "the committed config pair as shipped (emulated GPU): quiet-hour latency against "
                "the encoder alone, peak texts/s against the tensor path and the ideal batch"),
    "stack": ("stack_bench", "main", "raw ONNX Runtime against the full Triton stack"),
    "gateway": ("gateway_bench", "main",
                "the OpenAI gateway: against the SDK (sdk), queries under a bulk flood (priority), stalls (stall)"),
    "soak": ("soak", "main", "a long run at 70% of capacity with a kill -9, a dead stub, a spike"),
    "plan-cost": ("plan_cost", "main", "the text scheduler's planning cost per dispatch"),
    "probe": ("probe", "main", "how many closed-loop users this machine's server answers"),
    "rerank": ("rerank_bench", "main",
               "the reranker at RAG sizes (20/50/100 documents): pairs/s, p99, padding (--url: a running Triton)"),
    "gpu": ("gpu.bench_gpu", "main",
            "the GPU host's bench (torch encoder, five scenarios + text endpoint); on a GPU host run gpu/run.sh"),
}
TUNE: dict[str, tuple[str, str, str]] = {
    "delay": ("tune", "main", "the encoder's queue delay and preferred sizes (default; --url: a running Triton)"),
    "pair": ("shipped", "pair_main",
             "the encoder's batching and the text endpoint's settings together (--url: a running Triton)"),
}


# with --url (or BGE_TRITON_URL): the scenario that measures that running server instead of a local one
ON_URL: dict[tuple[str, str], str] = {("bench", "seed"): "seed", ("tune", "delay"): "tune_url",
                                      ("tune", "pair"): "tune_pair_url"}
# the scenarios whose own main takes --url (the running server, or else the servers it starts)
TAKES_URL = {("bench", "rerank")}


def url_given(argv: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Whether a command line (or BGE_TRITON_URL) names a running server."""
    return any(a == "--url" or a.startswith("--url=") for a in argv) or bool(environ.get("BGE_TRITON_URL"))


# why the scenarios without a --url variant start their own server
OWN_SERVER = {"soak": "kills the server with kill -9 and restarts it", "shipped": "runs the emulated GPU's configs",
              "chaos": "kills, stalls and restarts its servers"}


def refuse(scenario: str, why: str) -> int:
    """A scenario given --url that cannot use it: say why and what to do (exit 2)."""
    print(f"bge-triton {scenario}: it {why}, so it starts a Triton of its own and cannot run against --url; "
          "leave --url out. On a Triton you run: `bge-triton bench seed --url ...`, `bge-triton tune --url ...` "
          "and `bge-triton tune pair --url ...` (docs/tuning.md)", file=sys.stderr)
    return 2


def usage(command: str, table: dict[str, tuple[str, str, str]]) -> str:
    rows = "\n".join(f"  {name:<17} {what}" for name, (_, _, what) in table.items())
    return f"usage: bge-triton {command} <scenario> [flags]   (--help after the scenario for its flags)\n\n{rows}\n"


def _run(command: str, table: dict[str, tuple[str, str, str]], argv: Sequence[str],
         default: str | None = None) -> int:
    args = list(argv)
    if default is not None and (not args or args[0].startswith("-")) and args[:1] not in (["-h"], ["--help"]):
        args = [default, *args]
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(command, table))
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in table:
        print(f"bge-triton {command}: unknown scenario {name!r}\n\n{usage(command, table)}", file=sys.stderr)
        return 2
    module, function, _ = table[name]
    if (command, name) in ON_URL and url_given(rest, os.environ):
        module, function = ON_URL[command, name], "main"
    elif url_given(rest, {}) and (command, name) not in TAKES_URL:
        return refuse(f"{command} {name}", OWN_SERVER.get(name, "measures a server it starts itself"))
    return int(getattr(importlib.import_module(f"bge_triton.loadtest.{module}"), function)(rest) or 0)


def bench_main(argv: Sequence[str]) -> int:
    """`bge-triton bench <scenario> [flags]`."""
    return _run("bench", BENCH, argv)


def tune_main(argv: Sequence[str]) -> int:
    """`bge-triton tune [delay|pair] [flags]` (delay when no scenario is named)."""
    return _run("tune", TUNE, argv, default="delay")


def chaos_main(argv: Sequence[str]) -> int:
    """`bge-triton chaos [flags]`: bad input, overload and faults."""
    from bge_triton.loadtest import chaos

    if url_given(list(argv), {}):
        return refuse("chaos", OWN_SERVER["chaos"])
    return int(chaos.main(list(argv)) or 0)
