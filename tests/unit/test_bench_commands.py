"""The benchmark command tree (loadtest.commands): every scenario reaches its own parser, nothing hands over."""
from __future__ import annotations

import pytest

from bge_triton.loadtest import commands


@pytest.mark.parametrize("table, name", [(commands.BENCH, n) for n in commands.BENCH]
                         + [(commands.TUNE, n) for n in commands.TUNE])
def test_every_scenario_prints_its_own_help(table, name: str, capsys: pytest.CaptureFixture) -> None:
    run = commands.bench_main if table is commands.BENCH else commands.tune_main
    with pytest.raises(SystemExit) as info:
        run([name, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "bge-triton bench <scenario>" not in out  # the scenario's, not the tree's


def test_the_tree_lists_its_scenarios_and_rejects_unknown_ones(capsys: pytest.CaptureFixture) -> None:
    assert commands.bench_main([]) == 2
    listing = capsys.readouterr().out
    assert all(name in listing for name in commands.BENCH)
    assert commands.bench_main(["nope"]) == 2
    assert "unknown scenario 'nope'" in capsys.readouterr().err
    assert commands.tune_main(["--help"]) == 0 and "pair" in capsys.readouterr().out


def test_tune_without_a_scenario_is_the_delay_tuner(monkeypatch: pytest.MonkeyPatch) -> None:
    from bge_triton.loadtest import shipped, tune

    seen = []
    monkeypatch.setattr(tune, "main", lambda argv: seen.append(("delay", argv)) or 0)
    monkeypatch.setattr(shipped, "pair_main", lambda argv: seen.append(("pair", argv)) or 0)
    assert commands.tune_main(["--rate", "5"]) == 0 and commands.tune_main(["pair", "--quick"]) == 0
    assert seen == [("delay", ["--rate", "5"]), ("pair", ["--quick"])]


def test_chaos_has_no_soak_hand_over(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        commands.chaos_main(["--soak", "20m"])
    assert info.value.code == 2 and "unrecognized arguments: --soak" in capsys.readouterr().err


def test_url_sends_seed_and_tune_to_the_running_server_scenarios(monkeypatch: pytest.MonkeyPatch) -> None:
    from bge_triton.loadtest import bench, seed, tune, tune_url

    seen = []
    for module, name in ((bench, "local seed"), (seed, "url seed"), (tune, "local tune"), (tune_url, "url tune")):
        monkeypatch.setattr(module, "main", lambda argv, n=name: seen.append((n, argv)) or 0)
    monkeypatch.delenv("BGE_TRITON_URL", raising=False)
    commands.bench_main(["seed", "--quick"])
    commands.bench_main(["seed", "--url", "127.0.0.1:8001"])
    commands.tune_main(["--url=http://127.0.0.1:8000", "--slo-p99-ms", "5"])
    commands.tune_main(["--slo-p99-ms", "5", "--rate", "9"])
    monkeypatch.setenv("BGE_TRITON_URL", "127.0.0.1:8001")
    commands.bench_main(["seed"])
    assert [n for n, _ in seen] == ["local seed", "url seed", "url tune", "local tune", "url seed"]


def test_scenarios_that_start_their_own_server_refuse_a_url(capsys: pytest.CaptureFixture) -> None:
    assert commands.bench_main(["soak", "--url", "127.0.0.1:8001"]) == 2
    assert "kill -9" in capsys.readouterr().err
    assert commands.chaos_main(["--url=127.0.0.1:8001"]) == 2
    err = capsys.readouterr().err
    assert "cannot run against --url" in err and "leave --url out" in err
