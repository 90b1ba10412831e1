"""`bge-triton tune --url HOST:PORT --slo-p99-ms X`: tune the encoder's queue delay and preferred sizes on a Triton
you run. Each candidate is the SERVED config with only those fields changed, loaded as a config override while a
light load keeps flowing (a reload must lose no request: its errors count against the candidate), then driven by
open-loop Poisson load at each rate of --rates and by Locust's tidal shape (shapes.level) peaking at the highest.
Objective: a candidate's worst p99 over those loads; it meets the SLO when that is <= X with errors <= 1% and every
rate served. The pick: the lowest objective (within 2%: the shorter delay). --write DIR writes the pick into a model
repository; --apply loads it on the server; without --apply the served config is loaded back as found."""
from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from bge_triton import flags
from bge_triton.errors import InputError, KitError
from bge_triton.loadtest import engine, report, tune_report
from bge_triton.loadtest.core import preferred_sets
from bge_triton.loadtest.target import (
    Target,
    add_target_flags,
    config_diff,
    opening,
    override_config,
    restore,
    target_from,
    tokenizer_path,
)
from bge_triton.repository import Batching, dump_config, update_batching_in_place

PROBE_FRACTIONS = (0.15, 0.3, 0.45, 0.6, 0.75, 0.9)  # of the served config's closed-loop capacity


def add_sweep_flags(p: Any, delays_us: str, preferred: str, write_help: str, out: Path) -> None:
    """The flags of a tuner against a running Triton (tune --url, tune pair --url): target, SLO, loads, grid."""
    add_target_flags(p)
    p.add_argument("--slo-p99-ms", type=float, required=True, help="the p99 latency objective (ms)")
    p.add_argument("--rates", default="", help="open-loop rates, req/s (comma list; six or more draw curves); "
                   "default: 15%%..90%% of the served config's capacity, measured first")
    p.add_argument("--tidal-s", type=float, default=None, help="seconds of Locust's tidal shape per candidate, "
                   "peaking at the highest rate (0 = none; default 12, quick 4)")
    p.add_argument("--delays-us", default=delays_us, help="the encoder's max_queue_delay_microseconds candidates")
    p.add_argument("--preferred", default=preferred, help="the encoder's preferred_batch_size sets, ';'-separated "
                   "('none')")
    p.add_argument("--duration", type=float, default=None, help="seconds per rate (default 6; 1.5 quick)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up seconds per rate (default 1; 0.3 quick)")
    p.add_argument("--max-error-rate", type=float, default=0.01, help="errors allowed per candidate (fraction)")
    p.add_argument("--quick", action="store_true", help="short windows (a first look, or a test)")
    p.add_argument("--write", type=Path, default=None, metavar="DIR", help=write_help)
    p.add_argument("--apply", action="store_true", help="load the pick on the server and keep it (else the served "
                   "config is loaded back)")
    p.add_argument("--out", type=Path, default=out, help="report directory")


def check_sweep_args(p: Any, a: Any, argv: Sequence[str], prog: str) -> Any:
    """add_sweep_flags' values checked and completed (lists parsed, quick defaults); a.command names the run."""
    if not a.url:
        p.error("--url is required here (or BGE_TRITON_URL)")
    if a.slo_p99_ms <= 0:
        raise InputError(f"--slo-p99-ms {a.slo_p99_ms}: must be > 0")
    try:
        a.rates = tuple(float(v) for v in a.rates.split(",") if v.strip())
        a.delays_us = tuple(int(v) for v in a.delays_us.split(",") if v.strip())
    except ValueError as exc:
        raise InputError(f"--rates / --delays-us: expected comma lists of numbers ({exc})") from exc
    if any(r <= 0 for r in a.rates) or not a.delays_us or min(a.delays_us) < 0:
        raise InputError("--rates must be > 0 and --delays-us >= 0 (give at least one delay)")
    a.preferred = preferred_sets(a.preferred)
    a.duration = a.duration if a.duration is not None else (1.5 if a.quick else 6.0)
    a.warmup = a.warmup if a.warmup is not None else (0.3 if a.quick else 1.0)
    a.tidal_s = a.tidal_s if a.tidal_s is not None else (4.0 if a.quick else 12.0)
    if a.write is not None and not a.write.is_dir():
        raise InputError(f"--write {a.write}: not a directory; give the model repository the server loads from")
    a.command = f"{prog} " + " ".join(x if x != a.admin_key else "$KEY" for x in argv)
    return a


def parse_args(argv: Sequence[str]) -> Any:
    p = flags.parser("bge-triton tune", (__doc__ or "").split("\n\n")[0])
    add_sweep_flags(p, "0,1000,2000,5000,10000", "none;16,32", "write the pick into this model repository's "
                    "ENCODER/config.pbtxt (its batching fields only, through Triton's schema)",
                    Path.cwd() / "reports" / "tune" / "url")
    return check_sweep_args(p, flags.parse(p, argv), argv, "bge-triton tune")


def probe_rates(target: Target, model: str, inputs: list[str], texts: engine.Texts, a: Any) -> tuple[float, ...]:
    """Six rates from 15% to 90% of what `model` answers to 16 closed-loop users as served."""
    point = engine.measure(target, model, inputs, texts, engine.Load(users=16), a.warmup, a.duration)
    cap = point.row()["throughput"]
    if cap <= 0:
        why = point.first_error or "no error"
        raise InputError(f"the served {model} answered nothing in {a.duration:g} s ({why}); give --rates by hand, "
                         "or a longer --duration")
    rates = ", ".join(f"{f * cap:.1f}" for f in PROBE_FRACTIONS)
    print(f"served config: {cap:.1f} req/s at 16 users; rates {rates}", flush=True)
    return tuple(round(f * cap, 1) for f in PROBE_FRACTIONS)


def run_candidate(target: Target, a: Any, model: str, inputs: list[str], texts: engine.Texts, base: dict,
                  reload: Callable[[], Any] | None) -> list[dict]:
    """`reload` (the candidate's config loads) under a light load on `model` (its errors: the reload's; None: the
    candidate is what the server serves now, no reload row), then every rate of a.rates and the tidal run.
    Every row starts with `base` (the candidate's name and fields)."""
    name = base["candidate"]
    rows = []
    if reload is not None:
        point = engine.measure(target, model, inputs, texts, engine.Load(rate=min(a.rates)), 0.0, 1.5, side=reload)
        rows.append({**base, **point.row(), "kind": "reload"})
        print(f"{name}: reload under {min(a.rates):g}/s: {point.sent} requests, {point.errors} errors", flush=True)
    loads = [engine.Load(rate=r) for r in a.rates]
    if a.tidal_s > 0:
        loads.append(engine.Load(rate=max(a.rates), shape="tidal"))
    for load in loads:
        point = engine.measure(target, model, inputs, texts, load, a.warmup,
                               a.tidal_s if load.shape != "steady" else a.duration)
        rows.append({**base, **point.row(), "kind": load.shape})
        r = rows[-1]
        print(f"{name:34s} {load.label:>12s}: {r['throughput']:7.1f}/s  p50 {report.fmt(r['p50_ms'])}  p99 "
              f"{report.fmt(r['p99_ms'])} ms  batch {report.fmt(r['avg_batch'])}  errors {r['errors']}", flush=True)
    return rows


def _simplest(c: dict) -> tuple:
    return c["delay_us"], len(c["preferred"].split()), c["objective_p99_ms"]


def summarise(rows: list[dict], slo_ms: float, max_error_rate: float, tie: float = 0.02,
              fields: Sequence[str] = ("delay_us", "preferred"), order: Callable[[dict], Any] = _simplest
              ) -> list[dict]:
    """One line per candidate (its `fields` copied from its rows): objective (worst p99 of its loads), errors
    (reload included), whether each steady rate was served (throughput >= 90% of the offered rate), meets_slo; the
    pick marked `picked`: among those that meet the SLO within `tie` of the best objective, the first by `order`
    (default: the shorter delay, then fewer preferred sizes)."""
    out: list[dict] = []
    for name in dict.fromkeys(r["candidate"] for r in rows):
        mine = [r for r in rows if r["candidate"] == name]
        loads = [r for r in mine if r["kind"] != "reload"]
        sent, errors = sum(r["sent"] for r in mine), sum(r["errors"] for r in mine)
        p99s = [r["p99_ms"] for r in loads if r["n"]]
        objective = max(p99s) if len(p99s) == len(loads) and p99s else float("inf")
        served = all(r["throughput"] >= 0.9 * r["rate"] for r in loads if r["kind"] == "steady")
        out.append({"candidate": name, **{k: mine[0][k] for k in fields},
                    "objective_p99_ms": objective, "sent": sent, "errors": errors,
                    "reload_errors": sum(r["errors"] for r in mine if r["kind"] == "reload"), "served": served,
                    "meets_slo": objective <= slo_ms and served and errors <= max_error_rate * max(sent, 1),
                    "picked": False})
    ok = [c for c in out if c["meets_slo"]]
    if ok:
        best = min(c["objective_p99_ms"] for c in ok)
        pick = min((c for c in ok if c["objective_p99_ms"] <= (1 + tie) * best), key=order)
        pick["picked"] = True
    return out


def sweep(target: Target, a: Any, texts: engine.Texts, served: mc.ModelConfig
          ) -> tuple[list[dict], list[dict], mc.ModelConfig | None]:
    """Every candidate under every load: (rows, the candidates' summary, the pick's config or None)."""
    inputs = [i.name for i in served.input]
    a.rates = a.rates or probe_rates(target, target.encoder, inputs, texts, a)
    rows: list[dict] = []
    for pref in a.preferred:
        for delay in a.delays_us:
            cfg = override_config(served, Batching(preferred_batch_sizes=pref, max_queue_delay_us=delay))
            base = {"candidate": f"delay {delay} us, preferred {list(pref) or 'none'}", "delay_us": delay,
                    "preferred": " ".join(map(str, pref)) or "none"}
            rows += run_candidate(target, a, target.encoder, inputs, texts, base,
                                  functools.partial(target.load, target.encoder, cfg))
    summary = summarise(rows, a.slo_p99_ms, a.max_error_rate)
    pick = next((c for c in summary if c["picked"]), None)
    if pick is None:
        return rows, summary, None
    return rows, summary, override_config(served, picked_batching(pick))


def check_write_dir(write: Path | None, names: Sequence[str]) -> None:
    """--write must be the model repository the server loads from: each swept model's config.pbtxt is there."""
    if write is None:
        return
    for name in names:
        if not (write / name / "config.pbtxt").is_file():
            raise InputError(f"--write {write}: no {name}/config.pbtxt there; give the model repository the server "
                             "loads from (compose: ./model_repository)")


def picked_batching(pick: dict) -> Batching:
    return Batching(preferred_batch_sizes=tuple(int(v) for v in pick["preferred"].split() if v != "none"),
                    max_queue_delay_us=pick["delay_us"])


def main(argv: Sequence[str] | None = None) -> int:
    a, load0, t0 = opening(parse_args, argv)
    try:
        target = target_from(a)
        texts = engine.load_texts(tokenizer_path(a), a.seq_len)
        check_write_dir(a.write, [target.encoder])
        served = target.config(target.encoder)
    except KitError as exc:
        print(f"bge-triton tune: {exc}", file=sys.stderr)
        return 2
    try:
        rows, summary, picked_cfg = sweep(target, a, texts, served)
        if a.apply and picked_cfg is not None:
            target.load(target.encoder, picked_cfg)
            print(f"applied the pick on {target.url}")
        else:
            restore(target, target.encoder, served)
    except (KeyboardInterrupt, KitError) as exc:
        try:
            if target.encoder in target.loaded:  # a refused first load changed nothing
                restore(target, target.encoder, served)
        except KitError as again:
            print(f"bge-triton tune: could not load the served config of {target.encoder} back ({again}); load it "
                  f"yourself: tritonclient's load_model({target.encoder!r}) with the config in "
                  f"{a.out / 'served_config.pbtxt'}", file=sys.stderr)
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / "served_config.pbtxt").write_text(dump_config(served))
        if isinstance(exc, KeyboardInterrupt):
            print("interrupted: the served config was loaded back; no report written", file=sys.stderr)
            return 130
        print(f"bge-triton tune: {exc}", file=sys.stderr)
        return 2
    finally:
        target.close()
    pick = next((c for c in summary if c["picked"]), None)
    diff = config_diff(served, picked_cfg) if picked_cfg is not None else ""
    if a.write is not None and pick is not None:
        path = update_batching_in_place(a.write / target.encoder, picked_batching(pick))
        print(f"wrote the pick into {path}")
    print("config diff (served -> pick):\n" + (diff or "(none: the pick is the served config)") if pick else
          "no candidate meets the SLO: lower the rates, raise --slo-p99-ms, or add capacity")
    paths = tune_report.write(rows, summary, target, a, texts, load0, diff)
    print(f"tune done in {time.monotonic() - t0:.0f} s: " + ", ".join(map(str, paths)))
    return 0 if pick else 2
