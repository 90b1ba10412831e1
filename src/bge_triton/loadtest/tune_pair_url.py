"""`bge-triton tune pair --url HOST:PORT --slo-p99-ms X`: tune the encoder's batching AND the text endpoint's own
settings together on a Triton you run, under texts sent to the text endpoint (the path your RAG traffic takes).

Each candidate is the pair of SERVED configs with only its fields changed: the encoder's max_queue_delay_microseconds
and preferred sizes; the text endpoint's parameters max_in_flight, split_overhead_tokens, token_budget, sub_batch_max
and its instance count. The served pair is measured first, as found. A model a candidate leaves as loaded is not
reloaded, and the text endpoint's settings form the outer loop (the fewest reloads of the python model). Loads,
errors (a reload's included), objective and pick are those of `bge-triton tune --url`; among candidates within 2% of
the best objective the one with the fewest changes wins, so the served pair stays unless a change beats it.
--write DIR writes the pick into both configs of a model repository; --apply loads it on the server (the encoder
first); without --apply both served configs are loaded back, the text endpoint first, then its encoder."""
from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from bge_triton import flags
from bge_triton.errors import InputError, KitError
from bge_triton.loadtest import engine, tune_report, tune_url
from bge_triton.loadtest.target import (
    Target,
    config_diff,
    opening,
    override_config,
    target_from,
    tokenizer_path,
)
from bge_triton.repository import (
    Batching,
    dump_config,
    set_param,
    text_settings,
    update_batching_in_place,
    update_text_settings_in_place,
)

# the text endpoint's settings a candidate may change -> their flag; "instances" is its instance_group count
TEXT_AXES = {"max_in_flight": "--max-in-flight", "split_overhead_tokens": "--split-overhead",
             "token_budget": "--token-budget", "sub_batch_max": "--sub-batch-max", "instances": "--instances"}
LAYOUT = tune_report.Layout("pair", "Tune pair: the encoder's batching and the text endpoint's settings on a "
                            "running Triton", ("delay_us", "preferred", *TEXT_AXES, "changes"),
                            "texts to the text endpoint (its sub-batches reach the encoder through BLS)",
                            grid="candidates")


@dataclass
class Pair:
    """One candidate: its values (delay_us, preferred, each text axis), both configs in load order (the encoder
    first), its name, and how many values differ from the served pair."""

    values: dict[str, Any]
    configs: dict[str, mc.ModelConfig]
    name: str
    changes: int = 0

    def row(self) -> dict[str, Any]:
        """The candidate's columns, the start of each of its rows."""
        return {"candidate": self.name, **self.values, "changes": self.changes,
                "preferred": " ".join(map(str, self.values["preferred"])) or "none"}


def parse_args(argv: Sequence[str]) -> Any:
    p = flags.parser("bge-triton tune pair", (__doc__ or "").split("\n\n")[0])
    tune_url.add_sweep_flags(p, "0,5000", "none;16,32", "write the pick into this model repository: "
                             "ENCODER/config.pbtxt (its batching fields) and MODEL/config.pbtxt (the swept settings), "
                             "through Triton's schema", Path.cwd() / "reports" / "tune" / "url_pair")
    flags.no_env(p.add_argument("--max-in-flight", default="1,2", help="the text endpoint's max_in_flight candidates "
                                "(encoder sub-batches in flight per instance; '' = as served)"),
                 "BGE_TRITON_MAX_IN_FLIGHT is the gateway's setting")
    p.add_argument("--split-overhead", default=None, help="split_overhead_tokens candidates (the planner's cost of "
                   "one more encoder call, in tokens; default: as served)")
    p.add_argument("--token-budget", default=None, help="token_budget candidates (texts x padded tokens of one "
                   "encoder sub-batch; default: as served)")
    p.add_argument("--sub-batch-max", default=None, help="sub_batch_max candidates (texts per sub-batch, at most the "
                   "encoder's max_batch_size; default: as served)")
    p.add_argument("--instances", default=None, help="the text endpoint's instance counts (default: as served)")
    p.add_argument("--no-served", action="store_true", help="leave the served pair out of the candidates (by "
                   "default it is measured first, as the baseline a change must beat)")
    a = tune_url.check_sweep_args(p, flags.parse(p, argv), argv, "bge-triton tune pair")
    a.axes = parse_axes({key: getattr(a, flag[2:].replace("-", "_")) for key, flag in TEXT_AXES.items()})
    return a


def parse_axes(given: dict[str, str | None]) -> dict[str, tuple[int, ...]]:
    """{setting: its candidates} for each comma list given (an empty one: as served)."""
    out = {}
    for key, text in given.items():
        try:
            values = tuple(dict.fromkeys(int(v) for v in (text or "").split(",") if v.strip()))
        except ValueError as exc:
            raise InputError(f"{TEXT_AXES[key]} {text!r}: expected a comma list of whole numbers ({exc})") from exc
        if any(v < 1 for v in values) and key != "split_overhead_tokens" or any(v < 0 for v in values):
            raise InputError(f"{TEXT_AXES[key]} {text!r}: every value must be >= 1 (split overhead: >= 0)")
        if values:
            out[key] = values
    return out


def served_values(encoder: mc.ModelConfig, text: mc.ModelConfig) -> dict[str, Any]:
    """The served pair's value of every axis."""
    settings = text_settings(text)
    return {"delay_us": encoder.dynamic_batching.max_queue_delay_microseconds,
            "preferred": tuple(encoder.dynamic_batching.preferred_batch_size),
            **{k: getattr(settings, k) for k in TEXT_AXES if k != "instances"},
            "instances": text.instance_group[0].count if len(text.instance_group) == 1 else 0}


def pair_configs(served: dict[str, mc.ModelConfig], values: dict[str, Any], base: dict[str, Any]
                 ) -> dict[str, mc.ModelConfig]:
    """Both configs of a candidate: the served ones with only the values that differ from `base` changed."""
    encoder_name, text_name = served
    encoder = override_config(served[encoder_name], Batching(preferred_batch_sizes=values["preferred"],
                                                             max_queue_delay_us=values["delay_us"]))
    text = mc.ModelConfig()
    text.CopyFrom(served[text_name])
    for key in TEXT_AXES:
        if values[key] == base[key]:
            continue
        if key != "instances":
            set_param(text, key, values[key])
        elif len(text.instance_group) != 1:
            raise InputError(f"--instances: {text_name} is served with {len(text.instance_group)} instance groups; "
                             "the tuner changes the count of exactly one: leave --instances out")
        else:
            text.instance_group[0].count = values[key]
    settings = text_settings(text)  # a ModelConfigError names a value the text endpoint would refuse
    if encoder.max_batch_size and settings.sub_batch_max > encoder.max_batch_size:
        raise InputError(f"--sub-batch-max {settings.sub_batch_max}: more than the encoder's max_batch_size "
                         f"{encoder.max_batch_size}; choose sizes up to it")
    return {encoder_name: encoder, text_name: text}


def bypass_note(served: dict[str, mc.ModelConfig]) -> str:
    """'' when the text endpoint calls its encoder through BLS; else why the encoder's batching is left as served."""
    encoder_name, text_name = served
    how = text_settings(served[text_name]).encoder
    return "" if how == "bls" else (
        f"{text_name} runs its encoder itself (parameter encoder={how!r}, the kit's CPU variant), not through "
        f"{encoder_name}'s batcher: the encoder's batching stays as served and only the text endpoint's settings "
        "are swept (serve it with encoder 'bls', as on a GPU, to tune both)")


def candidates(served: dict[str, mc.ModelConfig], delays_us: Sequence[int],
               preferred: Sequence[tuple[int, ...]], axes: dict[str, tuple[int, ...]],
               with_served: bool = True) -> list[Pair]:
    """The served pair (if `with_served`), then the grid (text settings outer, the encoder's batching inner; the
    latter only when the text endpoint reaches the encoder through BLS); a point whose configs equal an earlier
    one's is measured once."""
    base = served_values(*served.values())
    if bypass_note(served):
        delays_us, preferred = (base["delay_us"],), (base["preferred"],)

    def name(values: dict[str, Any]) -> str:
        return (f"delay {values['delay_us']} us, preferred {list(values['preferred']) or 'none'}"
                + "".join(f"; {k} {values[k]}" for k in axes))

    pairs = [Pair(base, dict(served), "as served: " + name(base))] if with_served else []
    seen = {tuple(map(dump_config, served.values()))} if with_served else set()
    texts = itertools.product(*(axes.get(k, (base[k],)) for k in TEXT_AXES))
    for text, pref, delay in itertools.product(texts, preferred, delays_us):
        values = {"delay_us": delay, "preferred": pref, **dict(zip(TEXT_AXES, text, strict=True))}
        configs = pair_configs(served, values, base)
        key = tuple(map(dump_config, configs.values()))
        if key not in seen:
            seen.add(key)
            pairs.append(Pair(values, configs, name(values), sum(values[k] != base[k] for k in values)))
    return pairs


def load_changed(target: Target, want: dict[str, mc.ModelConfig], now: dict[str, mc.ModelConfig]) -> None:
    """Load each config of `want` that differs from what is loaded (`now`), in want's order: the encoder first."""
    for name, cfg in want.items():
        if cfg != now[name]:
            target.load(name, cfg)
            now[name] = cfg


def sweep(target: Target, a: Any, texts: engine.Texts, pairs: list[Pair], now: dict[str, mc.ModelConfig]
          ) -> list[dict]:
    """Every candidate under every load through the text endpoint; `now` follows what the server has loaded."""
    inputs = [i.name for i in now[target.model].input]
    a.rates = a.rates or tune_url.probe_rates(target, target.model, inputs, texts, a)
    rows: list[dict] = []
    for pair in pairs:
        changed = any(pair.configs[n] != now[n] for n in now)
        reload = functools.partial(load_changed, target, pair.configs, now) if changed else None
        rows += tune_url.run_candidate(target, a, target.model, inputs, texts, pair.row(), reload)
    return rows


def pick_order(c: dict) -> tuple:
    """Ties go to the fewest changes from the served pair, then the shorter delay and fewer preferred sizes."""
    return c["changes"], c["delay_us"], len(c["preferred"].split()), c["objective_p99_ms"]


def write_pick(a: Any, target: Target, pick: Pair) -> list[Path]:
    """The pick into a.write: the encoder's batching fields and the text endpoint's swept settings."""
    v = pick.values
    return [update_batching_in_place(a.write / target.encoder, Batching(preferred_batch_sizes=v["preferred"],
                                                                         max_queue_delay_us=v["delay_us"])),
            update_text_settings_in_place(a.write / target.model, v["instances"] if "instances" in a.axes else None,
                                          **{k: v[k] for k in a.axes if k != "instances"})]


def main(argv: Sequence[str] | None = None) -> int:
    a, load0, t0 = opening(parse_args, argv)
    try:
        target = target_from(a)
    except KitError as exc:
        print(f"bge-triton tune pair: {exc}", file=sys.stderr)
        return 2
    applied: list[bool] = []
    try:
        texts = engine.load_texts(tokenizer_path(a), a.seq_len)
        tune_url.check_write_dir(a.write, [target.encoder, target.model])
        with target.holding([target.encoder, target.model], keep=lambda: bool(applied),
                            rescue=a.out / "served") as served:
            pairs = candidates(served, a.delays_us, a.preferred, a.axes, not a.no_served)
            notes = [f"Note: {note}."] if (note := bypass_note(served)) else []
            if notes:
                print(*notes, flush=True)
            first = "" if a.no_served else " (the served pair first)"
            print(f"{len(pairs)} candidates{first} on {target.url}: texts to {target.model}, encoder "
                  f"{target.encoder}", flush=True)
            now = dict(served)
            rows = sweep(target, a, texts, pairs, now)
            summary = tune_url.summarise(rows, a.slo_p99_ms, a.max_error_rate, fields=LAYOUT.fields,
                                         order=pick_order)
            pick = next((p for p in pairs for c in summary if c["picked"] and c["candidate"] == p.name), None)
            if a.apply and pick is not None:
                load_changed(target, pick.configs, now)
                applied.append(True)
                print(f"applied the pick on {target.url}: {pick.name}", flush=True)
    except (KeyboardInterrupt, KitError) as exc:
        if isinstance(exc, KeyboardInterrupt):
            print("interrupted: the served configs were loaded back; no report written", file=sys.stderr)
            return 130
        print(f"bge-triton tune pair: {exc}", file=sys.stderr)
        return 2
    finally:
        target.close()
    diffs = [(n, config_diff(served[n], pick.configs[n])) for n in served] if pick is not None else []
    written = write_pick(a, target, pick) if a.write is not None and pick is not None else []
    for path in written:
        print(f"wrote the pick into {path}")
    for n, diff in diffs:
        print(f"config diff of {n} (served -> pick):\n" + (diff or "(none: the pick is the served config)"))
    if pick is None:
        print("no candidate meets the SLO: lower the rates, raise --slo-p99-ms, or add capacity")
    layout = dataclasses.replace(LAYOUT, shown=tuple(a.axes))
    paths = tune_report.write_report(rows, summary, target, a, texts, load0, diffs, layout, written, notes)
    print(f"tune pair done in {time.monotonic() - t0:.0f} s: " + ", ".join(map(str, paths)))
    return 0 if pick is not None else 2
