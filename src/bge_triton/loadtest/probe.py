"""`bge-triton bench probe`: the closed-loop users this machine's tritonserver answers (a scenario of its own; the
sweep's pieces it uses live in loadtest.sweep)."""
from __future__ import annotations

import sys

from bge_triton import flags
from bge_triton.loadtest import core
from bge_triton.loadtest.sweep import CONNECTS_PER_S, DEFAULT_SWEEP, parse_concurrency
from bge_triton.paths import STATE_DIR


def main(argv: list[str] | None = None) -> int:
    """`bge-triton bench probe`: how many closed-loop users this machine's tritonserver answers,
    against the no-op model (the harness self-check), one fresh server per C so a stall cannot carry over."""
    p = flags.parser("bge-triton bench probe", " ".join((main.__doc__ or "").split()))
    core.add_flags(p, ("concurrency", DEFAULT_SWEEP, "users per probe", parse_concurrency),
                    ("ramp-s", None, f"seconds over which the users connect (default C / {CONNECTS_PER_S:g}; 0 = all "
                                     "at once)", float), ("duration", 2.0, "seconds per probe window (at least 2)"),
                    ("state-dir", STATE_DIR / "loadtest" / "sweep_probe", "server state directory"))
    a = flags.parse(p, sys.argv[1:] if argv is None else argv)
    s = core.BenchSettings(state_dir=a.state_dir / "state", duration_s=2 * a.duration, command=p.prog)
    for c in a.concurrency:
        ramp = c / CONNECTS_PER_S if a.ramp_s is None else a.ramp_s
        with core.stand(s, "repo", False, c, ramp) as h:  # prints the probe's line
            res = h.self_check_result
        if res is not None and res.first_error:
            print(f"C={c} ramp {ramp:.2f} s: {res.errors} errors ({res.first_error})", flush=True)
    return 0
