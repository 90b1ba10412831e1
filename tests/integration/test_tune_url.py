"""`bge-triton bench seed --url` and `bge-triton tune --url` against a tritonserver started separately, as a user's
server is (explicit model control, every model loaded at start, the repository API behind a key): run as
subprocesses the way docs/tuning.md writes them (short windows, few loads, so CI's 2 cores keep up). Every scenario
is measured, the served config is back afterwards (also after a Ctrl-C in the middle), the server stays ready, and
requests sent through the tuner's reloads are all answered."""
from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from bge_triton.loadtest.target import Target
from bge_triton.paths import IMPORT_ROOT
from bge_triton.repository import load_config

KEY = "tune-test-admin-key-0123456789"
ENCODER = "minilm_onnx"
SMALL = ["--model", "minilm", "--seq-len", "16", "--quick"]  # the test's texts: short, so CPU windows hold batches


@pytest.fixture(scope="module")
def user_server(minilm_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """A server as a user runs it: explicit control, --load-model=*, the model-repository API restricted to KEY."""
    target = Target.start_local(minilm_repo, tmp_path_factory.mktemp("user_server"), "minilm", admin_key=KEY)
    assert target.encoder == ENCODER and target.started  # read from the text endpoint's config
    yield target.server
    target.stop()


@pytest.fixture()
def workdir(minilm_repo: Path, tmp_path: Path) -> Path:
    """A user's directory: ./model_repository/<model>/1/tokenizer is where the commands look for the tokenizer."""
    (tmp_path / "model_repository" / "minilm" / "1").mkdir(parents=True)
    (tmp_path / "model_repository" / "minilm" / "1" / "tokenizer").symlink_to(minilm_repo / "minilm" / "1" /
                                                                               "tokenizer")
    return tmp_path


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "bge_triton.cli", *args]


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("BGE_TRITON_")}
    return {**e, "PYTHONPATH": os.pathsep.join(filter(None, [str(IMPORT_ROOT), e.get("PYTHONPATH")]))}


def served(srv) -> str:
    with grpcclient.InferenceServerClient(srv.grpc_url) as c:
        return str(c.get_model_config(ENCODER).config)


def target_flags(srv) -> list[str]:
    return ["--url", srv.grpc_url, "--admin-key", KEY, "--metrics-url", srv.metrics_url]


def rows(path: Path) -> list[dict]:
    return list(csv.DictReader(line for line in path.read_text().splitlines() if not line.startswith("#")))


def test_bench_seed_url_measures_every_scenario_and_restores_the_served_config(user_server, workdir: Path) -> None:
    before = served(user_server)
    out = subprocess.run(command("bench", "seed", *target_flags(user_server), *SMALL, "--users", "1,2",
                                 "--static-users", "32", "--out", "seed"),
                         cwd=workdir, env=env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = rows(workdir / "seed" / "seed.csv")
    assert {r["scenario"] for r in got} == {"no_batching", "static_32", "dynamic_5ms", "delay_0", "text_endpoint"}
    assert all(int(r["n"]) > 0 and int(r["errors"]) == 0 for r in got), got
    static = next(r for r in got if r["scenario"] == "static_32")
    assert "32x" in static["batches"], static  # Triton formed full batches of 32 under the override
    assert served(user_server) == before
    with grpcclient.InferenceServerClient(user_server.grpc_url) as c:
        assert c.is_server_ready() and c.is_model_ready("minilm") and c.is_model_ready(ENCODER)
    assert (workdir / "seed" / "seed.png").read_bytes()[:4] == b"\x89PNG"
    assert KEY not in (workdir / "seed" / "seed.md").read_text()  # the key never reaches a report


class Traffic:
    """Threads sending encoder requests back to back until stopped; every request's outcome is kept."""

    def __init__(self, url: str, threads: int = 2) -> None:
        self.url, self.halt, self.lock = url, threading.Event(), threading.Lock()
        self.outcomes: list[str] = []
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(threads)]

    def run(self) -> None:
        ids = np.random.default_rng(0).integers(1000, 2000, (1, 16), dtype=np.int64)
        with grpcclient.InferenceServerClient(self.url) as c:
            while not self.halt.is_set():
                inputs = [grpcclient.InferInput(n, [1, 16], "INT64") for n in ("input_ids", "attention_mask")]
                inputs[0].set_data_from_numpy(ids)
                inputs[1].set_data_from_numpy(np.ones_like(ids))
                try:
                    c.infer(ENCODER, inputs, client_timeout=60)
                    outcome = "ok"
                except Exception as exc:  # every failure is an outcome to report
                    outcome = str(exc)[:200]
                with self.lock:
                    self.outcomes.append(outcome)

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.halt.set()
        for t in self.threads:
            t.join(timeout=90)


def test_tune_url_reloads_lose_no_request_restores_and_writes_the_pick(user_server, workdir: Path,
                                                                       minilm_repo: Path) -> None:
    before = served(user_server)
    repo = workdir / "model_repository"
    (repo / ENCODER).mkdir()
    (repo / ENCODER / "config.pbtxt").write_text((minilm_repo / ENCODER / "config.pbtxt").read_text())
    with Traffic(user_server.grpc_url) as traffic:
        out = subprocess.run(command("tune", *target_flags(user_server), *SMALL, "--slo-p99-ms", "60000",
                                     "--delays-us", "0,3000", "--preferred", "none", "--rates", "4,8",
                                     "--tidal-s", "2", "--write", "model_repository", "--out", "tune"),
                             cwd=workdir, env=env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lost = [o for o in traffic.outcomes if o != "ok"]
    assert traffic.outcomes and not lost, lost[:5]  # requests in flight through two reloads and two restores
    candidates = rows(workdir / "tune" / "tune_candidates.csv")
    assert len(candidates) == 2 and all(int(c["reload_errors"]) == 0 and int(c["sent"]) > 0 for c in candidates)
    loads = rows(workdir / "tune" / "tune.csv")
    assert {r["kind"] for r in loads} == {"reload", "steady", "tidal"}
    assert served(user_server) == before  # no --apply: the served config as found
    pick = next(c for c in candidates if c["picked"] == "True")
    written = load_config(repo / ENCODER)
    assert written.dynamic_batching.max_queue_delay_microseconds == int(pick["delay_us"])
    assert list(written.dynamic_batching.preferred_batch_size) == []
    assert "config diff (served -> pick)" in out.stdout


def test_tune_url_apply_keeps_the_pick_on_the_server(user_server, workdir: Path) -> None:
    original = None
    with grpcclient.InferenceServerClient(user_server.grpc_url) as c:
        original = c.get_model_config(ENCODER, as_json=True)["config"]
    try:
        out = subprocess.run(command("tune", *target_flags(user_server), *SMALL, "--slo-p99-ms", "60000",
                                     "--delays-us", "1234", "--preferred", "8", "--rates", "4", "--tidal-s", "0",
                                     "--apply", "--out", "tune"),
                             cwd=workdir, env=env(), capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        with grpcclient.InferenceServerClient(user_server.grpc_url) as c:
            cfg = c.get_model_config(ENCODER).config
        assert cfg.dynamic_batching.max_queue_delay_microseconds == 1234
        assert list(cfg.dynamic_batching.preferred_batch_size) == [8]
    finally:
        import json

        with grpcclient.InferenceServerClient(user_server.grpc_url) as c:
            c.load_model(ENCODER, config=json.dumps(original),
                         headers={"triton-grpc-protocol-triton-admin-key": KEY})


def test_ctrl_c_in_the_middle_of_bench_seed_restores_the_served_config(user_server, workdir: Path) -> None:
    before = served(user_server)
    proc = subprocess.Popen(command("bench", "seed", *target_flags(user_server), *SMALL, "--duration", "60",
                                    "--scenarios", "dynamic_5ms,delay_0", "--out", "seed"),
                            cwd=workdir, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # progress, not time: wait until the scenario's override is the served config, then interrupt
        with grpcclient.InferenceServerClient(user_server.grpc_url) as c:
            while proc.poll() is None and c.get_model_config(ENCODER).config.dynamic_batching \
                    .max_queue_delay_microseconds != 5000:
                threading.Event().wait(0.2)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output[-3000:]
    assert "restored the served config" in output
    assert served(user_server) == before
