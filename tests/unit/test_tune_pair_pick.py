"""`bge-triton tune pair --url` without a server: the grid built from the served configs (only the swept fields
change, the served pair first, text settings in the outer loop), its flags, the pick (the fewest changes win ties),
both models restored in the reverse order however the run ends (a fake tritonclient records every load), and the
report written from rows."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc

from bge_triton.errors import InputError, KitError, ModelConfigError
from bge_triton.flags import ServerUrl
from bge_triton.loadtest import tune_pair_url as pair
from bge_triton.loadtest.engine import Texts
from bge_triton.loadtest.target import Target, config_diff
from bge_triton.loadtest.tune_url import summarise
from bge_triton.repository import DEFAULT_CANONICAL, load_config, parse_config, set_param

ENC, TXT = "bge_large_zh_onnx", "bge_large_zh"


def served() -> dict[str, mc.ModelConfig]:
    """The committed pair as a server serves it (encoder delay 0, no preferred sizes; max_in_flight 2)."""
    return {ENC: load_config(DEFAULT_CANONICAL / ENC), TXT: load_config(DEFAULT_CANONICAL / TXT)}


def changed_lines(before: mc.ModelConfig, after: mc.ModelConfig) -> list[str]:
    return [line[0] + line[1:].strip() for line in config_diff(before, after).splitlines()
            if line[:1] in "+-" and line[:3] not in ("---", "+++")]


def test_the_grid_starts_with_the_served_pair_and_changes_only_the_swept_fields() -> None:
    found = served()
    pairs = pair.candidates(found, (0, 5000), ((), (16, 32)), {"max_in_flight": (1, 2)})
    assert pairs[0].name == "as served: delay 0 us, preferred none; max_in_flight 2" and pairs[0].changes == 0
    assert pairs[0].configs == found
    # 2 delays x 2 preferred sets x 2 max_in_flight, less the point equal to the served pair (measured once)
    assert len(pairs) == 8 and len({p.name for p in pairs}) == 8
    assert [p.values["max_in_flight"] for p in pairs[1:]] == [1, 1, 1, 1, 2, 2, 2]  # the text endpoint outer
    for p in pairs[1:]:
        enc, txt = changed_lines(found[ENC], p.configs[ENC]), changed_lines(found[TXT], p.configs[TXT])
        assert all(line.startswith(("+max_queue_delay_microseconds", "+preferred_batch_size")) for line in enc), enc
        assert txt in ([], ['-string_value: "2"', '+string_value: "1"']), txt
        assert p.configs[TXT].parameters["max_in_flight"].string_value == str(p.values["max_in_flight"])
        assert p.changes == sum(p.values[k] != pairs[0].values[k] for k in p.values)
    assert list(pairs[1].configs) == [ENC, TXT]  # the load order: the encoder first


def test_instances_and_the_other_settings_and_what_the_grid_refuses() -> None:
    found = served()
    got = pair.candidates(found, (0,), ((),), {"instances": (3,), "token_budget": (4096,), "sub_batch_max": (32,)})
    txt = got[1].configs[TXT]
    assert txt.instance_group[0].count == 3 and txt.parameters["token_budget"].string_value == "4096"
    assert got[1].configs[ENC] == found[ENC] and got[1].changes == 3
    with pytest.raises(InputError, match="--sub-batch-max 128: more than the encoder's max_batch_size 64"):
        pair.candidates(found, (0,), ((),), {"sub_batch_max": (128,)})
    with pytest.raises(InputError, match="preferred sizes"):
        pair.candidates(found, (0,), ((128,),), {})
    with pytest.raises(InputError, match="--max-in-flight"):
        pair.parse_axes({"max_in_flight": "0,1"})
    with pytest.raises(InputError, match="--token-budget 'x'"):
        pair.parse_axes({"token_budget": "x"})
    assert pair.parse_axes({"split_overhead_tokens": "0,64,64", "max_in_flight": None}) == {
        "split_overhead_tokens": (0, 64)}
    bad = served()
    set_param(bad[TXT], "max_length", "many")
    with pytest.raises(ModelConfigError, match="max_length"):
        pair.candidates(bad, (0,), ((),), {})


def test_an_endpoint_that_runs_its_encoder_itself_keeps_the_encoders_batching() -> None:
    found = served()
    set_param(found[TXT], "encoder", "inprocess")
    pairs = pair.candidates(found, (0, 5000), ((), (16, 32)), {"max_in_flight": (1, 2)})
    assert "encoder='inprocess'" in pair.bypass_note(found) and pair.bypass_note(served()) == ""
    assert len(pairs) == 2 and all(p.configs[ENC] == found[ENC] for p in pairs)


def test_flags_default_grid_and_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BGE_TRITON_MAX_IN_FLIGHT", "64")  # the gateway's setting: not this grid's
    monkeypatch.setenv("BGE_TRITON_TOKEN_BUDGET", "4096,8192")
    a = pair.parse_args(["--url", "127.0.0.1:8001", "--slo-p99-ms", "50", "--admin-key", "secret-key"])
    assert (a.delays_us, a.preferred, a.axes) == ((0, 5000), ((), (16, 32)), {"max_in_flight": (1, 2),
                                                                               "token_budget": (4096, 8192)})
    assert a.out.parts[-3:] == ("reports", "tune", "url_pair") and "secret-key" not in a.command
    assert a.command.startswith("bge-triton tune pair --url")
    with pytest.raises(InputError, match="--write"):
        pair.parse_args(["--url", "h:1", "--slo-p99-ms", "5", "--write", str(tmp_path / "none")])


def rows_for(name: str, changes: int, delay: int, worst: float, reload_errors: int = 0) -> list[dict]:
    base = {"candidate": name, "delay_us": delay, "preferred": "none", "max_in_flight": 2,
            "split_overhead_tokens": 628, "token_budget": 8192, "sub_batch_max": 64, "instances": 2,
            "changes": changes}
    base |= {"avg_ms": 1.0, "p50_ms": 1.0, "avg_batch": 2.0, "gpu_util": math.nan, "cpu_util": 0.5,
             "first_error": "", "users": 0}
    out = [] if not changes else [{**base, "kind": "reload", "sent": 10, "errors": reload_errors, "n": 10,
                                   "p99_ms": 1.0, "throughput": 10.0, "rate": 10.0, "load": "10/s"}]
    return out + [{**base, "kind": "steady", "rate": r, "throughput": r, "sent": 100, "errors": 0, "n": 100,
                   "p99_ms": worst * r / 20, "load": f"{r:g}/s"} for r in (10.0, 20.0)]


def test_the_served_pair_wins_ties_and_a_lost_request_disqualifies() -> None:
    rows = (rows_for("served", 0, 5000, 30.0) + rows_for("a", 1, 0, 29.7) + rows_for("b", 2, 0, 20.0,
                                                                                       reload_errors=1))
    summary = {c["candidate"]: c for c in summarise(rows, 50.0, 0.001, fields=pair.LAYOUT.fields,
                                                    order=pair.pick_order)}
    assert summary["served"]["picked"]  # a is within 2%: changing nothing wins
    assert not summary["b"]["meets_slo"] and summary["b"]["reload_errors"] == 1
    rows = rows_for("served", 0, 5000, 30.0) + rows_for("a", 1, 0, 25.0)
    assert [c["picked"] for c in summarise(rows, 50.0, 0.01, fields=pair.LAYOUT.fields, order=pair.pick_order)] \
        == [False, True]


class TwoModels:
    """tritonclient's gRPC client as far as Target uses it, for two models: configs served, loads recorded."""

    def __init__(self, fail: str | None = None) -> None:
        self.cfg, self.loads, self.fail = served(), [], fail

    def get_model_config(self, name: str) -> Any:
        got = mc.ModelConfig()
        got.CopyFrom(self.cfg[name])
        return SimpleNamespace(config=got)

    def load_model(self, name: str, config: str, headers: dict | None = None) -> None:
        self.loads.append(name)
        cfg = json_format.ParseDict(json.loads(config), mc.ModelConfig())
        if name == self.fail and cfg == served()[name]:
            raise RuntimeError("[StatusCode.UNAVAILABLE] failed to load")
        self.cfg[name] = cfg

    def close(self) -> None:
        pass


def fake_target(client: TwoModels) -> Target:
    return Target(ServerUrl("grpc", "127.0.0.1:1"), TXT, ENC, "k" * 20, "", _client=client)


@pytest.mark.parametrize("ending", ["ok", "error", "ctrl-c", "apply"])
def test_both_served_configs_come_back_text_endpoint_first(ending: str) -> None:
    client, applied = TwoModels(), []
    target = fake_target(client)
    try:
        with target.holding([ENC, TXT], keep=lambda: bool(applied)) as found:
            pairs = pair.candidates(found, (3000, 0), ((),), {"max_in_flight": (1,)})
            now = dict(found)
            for p in pairs[1:]:
                pair.load_changed(target, p.configs, now)
            if ending == "apply":
                applied.append(True)
            elif ending != "ok":
                raise {"error": KitError, "ctrl-c": KeyboardInterrupt}[ending]("stop")
    except (KitError, KeyboardInterrupt):
        assert ending in ("error", "ctrl-c")
    # delay 3000 + max_in_flight 1: both models, the encoder first; delay 0: the encoder only (the text endpoint
    # is loaded as this candidate has it)
    assert client.loads[:3] == [ENC, TXT, ENC]
    if ending == "apply":
        assert client.loads == [ENC, TXT, ENC] and client.cfg[TXT].parameters["max_in_flight"].string_value == "1"
    else:
        assert client.loads[3:] == [TXT, ENC] and client.cfg == served()


def test_a_failed_restore_still_restores_the_encoder_and_saves_the_config(tmp_path: Path) -> None:
    client = TwoModels(fail=TXT)
    target = fake_target(client)
    with pytest.raises(KitError, match=f"could not load the served config back: {TXT}") as info:
        with target.holding([ENC, TXT], rescue=tmp_path / "served") as found:
            pair.load_changed(target, pair.candidates(found, (3000,), ((),), {"max_in_flight": (1,)})[1].configs,
                              dict(found))
    assert str(tmp_path / "served") in str(info.value)
    assert client.loads[-2:] == [TXT, ENC] and client.cfg[ENC] == served()[ENC]
    assert parse_config((tmp_path / "served" / f"{TXT}.pbtxt").read_text()) == served()[TXT]
    assert not (tmp_path / "served" / f"{ENC}.pbtxt").exists()


def test_the_pair_report_gives_both_diffs_and_a_chart_per_candidate(tmp_path: Path) -> None:
    from bge_triton.loadtest import tune_report

    found = served()
    pairs = pair.candidates(found, (0,), ((),), {"max_in_flight": (1, 2)})
    rows = rows_for(pairs[0].name, 0, 0, 30.0) + rows_for(pairs[1].name, 1, 0, 20.0)
    summary = summarise(rows, 50.0, 0.01, fields=pair.LAYOUT.fields, order=pair.pick_order)
    a = SimpleNamespace(out=tmp_path, command="bge-triton tune pair --url 127.0.0.1:8001 --slo-p99-ms 50",
                        rates=(10.0, 20.0), warmup=0.3, duration=1.0, tidal_s=0.0, slo_p99_ms=50.0,
                        max_error_rate=0.01, apply=False, write=None)
    ids = np.ones((3, 16), np.int64)
    target = Target(ServerUrl("grpc", "127.0.0.1:8001"), TXT, ENC, None, "")
    diffs = [(n, config_diff(found[n], pairs[1].configs[n])) for n in found]
    paths = tune_report.write_report(rows, summary, target, a, Texts(("a", "b", "c"), ids, ids), (1.0, 1.0, 1.0),
                                     diffs, dataclasses.replace(pair.LAYOUT, shown=("max_in_flight",)),
                                     notes=["Note: a note."])
    md = paths[0].read_text()
    assert [p.name for p in paths] == ["pair.md", "pair.csv", "pair_candidates.csv", "pair.png", "pair_curves.png"]
    assert f"Pick: **{pairs[1].name}**" in md and "Note: a note." in md
    assert f"## Config diff of {TXT}" in md and f"## Config diff of {ENC}" not in md  # the encoder is unchanged
    assert f"| {pairs[0].name} | 2 | 30.0 |" in md
    assert paths[3].read_bytes()[:4] == b"\x89PNG"
    header = paths[2].read_text().splitlines()[1].split(",")
    assert header[:10] == ["candidate", "delay_us", "preferred", "max_in_flight", "split_overhead_tokens",
                           "token_budget", "sub_batch_max", "instances", "changes", "objective_p99_ms"]


def test_write_must_be_the_served_repository_with_every_swept_model(tmp_path: Path) -> None:
    """--write names the first swept model whose config.pbtxt is missing, before any load; without --write or with
    every config there, nothing is raised."""
    from bge_triton.loadtest.tune_url import check_write_dir

    (tmp_path / "minilm_onnx").mkdir()
    (tmp_path / "minilm_onnx" / "config.pbtxt").write_text('name: "minilm_onnx"\n', encoding="utf-8")
    check_write_dir(None, ["minilm_onnx", "minilm"])
    check_write_dir(tmp_path, ["minilm_onnx"])
    with pytest.raises(InputError) as exc:
        check_write_dir(tmp_path, ["minilm_onnx", "minilm"])
    assert str(exc.value).startswith(f"--write {tmp_path}: no minilm/config.pbtxt there")
    assert "minilm_onnx/config.pbtxt" not in str(exc.value)
