"""`bge-triton tune pair --url` against a tritonserver started separately, as a user's server is (explicit model
control, every model loaded at start, the repository API behind a key), its text endpoint reaching the encoder
through BLS as on a GPU. Run as subprocesses the way docs/tuning.md writes them, with tiny grids: every candidate
is measured, both served configs are back afterwards (also after a SIGTERM in the middle), --apply changes only the
swept fields of each model, the server stays ready, and texts sent through the reloads are all answered."""
from __future__ import annotations

import json
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from test_tune_url import KEY, Traffic, command, env, rows, target_flags

from bge_triton.loadtest.target import Target
from bge_triton.repository import load_config
from bge_triton.server.cpu_variant import CPU_TEXT_PARAMS, CpuVariant

MODEL, ENCODER = "minilm", "minilm_onnx"
SMALL = ["--model", MODEL, "--seq-len", "16", "--quick", "--slo-p99-ms", "60000"]


@pytest.fixture(scope="module")
def user_server(minilm_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """A server as a user runs it, the text endpoint on BLS (encoder "bls": the encoder's batcher is on its path)."""
    variant = CpuVariant(text_params={**CPU_TEXT_PARAMS, "encoder": "bls"})
    target = Target.start_local(minilm_repo, tmp_path_factory.mktemp("pair_server"), MODEL, admin_key=KEY,
                                variant=variant)
    yield target.server
    target.stop()


@pytest.fixture()
def workdir(minilm_repo: Path, tmp_path: Path) -> Path:
    """A user's directory: ./model_repository/<model>/1/tokenizer is where the commands look for the tokenizer."""
    (tmp_path / "model_repository" / MODEL / "1").mkdir(parents=True)
    (tmp_path / "model_repository" / MODEL / "1" / "tokenizer").symlink_to(minilm_repo / MODEL / "1" / "tokenizer")
    return tmp_path


def configs(srv) -> dict[str, grpcclient.model_config_pb2.ModelConfig]:
    with grpcclient.InferenceServerClient(srv.grpc_url) as c:
        return {name: c.get_model_config(name).config for name in (ENCODER, MODEL)}


class TextTraffic(Traffic):
    """Threads sending one text to the text endpoint back to back until stopped; every outcome is kept."""

    def run(self) -> None:
        with grpcclient.InferenceServerClient(self.url) as c:
            while not self.halt.is_set():
                inp = grpcclient.InferInput("text", [1, 1], "BYTES")
                inp.set_data_from_numpy(np.array([["一句话, through the reloads".encode()]], dtype=np.object_))
                try:
                    c.infer(MODEL, [inp], client_timeout=60)
                    outcome = "ok"
                except Exception as exc:  # every failure is an outcome to report
                    outcome = str(exc)[:200]
                with self.lock:
                    self.outcomes.append(outcome)


def test_tune_pair_url_measures_every_candidate_loses_no_text_and_restores_both(user_server, workdir: Path,
                                                                                 minilm_repo: Path) -> None:
    before = configs(user_server)
    assert before[MODEL].parameters["max_in_flight"].string_value == "1"  # so max_in_flight 2 is a change
    repo = workdir / "model_repository"
    for name in (ENCODER, MODEL):
        (repo / name).mkdir(exist_ok=True)
        (repo / name / "config.pbtxt").write_text((minilm_repo / name / "config.pbtxt").read_text())
    with TextTraffic(user_server.grpc_url) as traffic:
        out = subprocess.run(command("tune", "pair", *target_flags(user_server), *SMALL, "--delays-us", "0,3000",
                                     "--preferred", "none", "--max-in-flight", "2", "--rates", "4,8",
                                     "--tidal-s", "2", "--write", "model_repository", "--out", "pair"),
                             cwd=workdir, env=env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lost = [o for o in traffic.outcomes if o != "ok"]
    assert traffic.outcomes and not lost, lost[:5]  # texts in flight through the reloads and both restores
    candidates = rows(workdir / "pair" / "pair_candidates.csv")
    assert [c["candidate"].split(":")[0] for c in candidates][0] == "as served"
    assert len(candidates) == 3 and all(int(c["sent"]) > 0 and int(c["errors"]) == 0 for c in candidates)
    loads = rows(workdir / "pair" / "pair.csv")
    reloads = [r for r in loads if r["kind"] == "reload"]
    assert len(reloads) == 2 and all(int(r["sent"]) > 0 and int(r["errors"]) == 0 for r in reloads), reloads
    assert {r["kind"] for r in loads} == {"reload", "steady", "tidal"}
    assert all(r["avg_batch"] != "-" for r in loads if r["kind"] == "steady")  # the texts reached the encoder
    assert configs(user_server) == before  # no --apply: both served configs as found
    restored = [line for line in out.stdout.splitlines() if line.startswith("restored the served config")]
    assert restored == [f"restored the served config of {MODEL}", f"restored the served config of {ENCODER}"]
    pick = next(c for c in candidates if c["picked"] == "True")
    written_encoder, written_text = load_config(repo / ENCODER), load_config(repo / MODEL)
    assert written_encoder.dynamic_batching.max_queue_delay_microseconds == int(pick["delay_us"])
    assert written_text.parameters["max_in_flight"].string_value == pick["max_in_flight"]
    assert (workdir / "pair" / "pair.png").read_bytes()[:4] == b"\x89PNG"
    assert KEY not in (workdir / "pair" / "pair.md").read_text()
    with grpcclient.InferenceServerClient(user_server.grpc_url) as c:
        assert c.is_server_ready() and c.is_model_ready(MODEL) and c.is_model_ready(ENCODER)


def test_tune_pair_url_apply_changes_only_the_swept_fields_of_each_model(user_server, workdir: Path) -> None:
    with grpcclient.InferenceServerClient(user_server.grpc_url) as c:
        original = {name: c.get_model_config(name, as_json=True)["config"] for name in (ENCODER, MODEL)}
    before = configs(user_server)
    try:
        out = subprocess.run(command("tune", "pair", *target_flags(user_server), *SMALL, "--no-served",
                                     "--delays-us", "1234", "--preferred", "8", "--max-in-flight", "2",
                                     "--rates", "4", "--tidal-s", "0", "--apply", "--out", "pair"),
                             cwd=workdir, env=env(), capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        after = configs(user_server)
        assert after[ENCODER].dynamic_batching.max_queue_delay_microseconds == 1234
        assert list(after[ENCODER].dynamic_batching.preferred_batch_size) == [8]
        assert after[MODEL].parameters["max_in_flight"].string_value == "2"
        after[MODEL].parameters["max_in_flight"].string_value = "1"  # nothing else changed
        for cfg in (after[ENCODER], before[ENCODER]):
            cfg.dynamic_batching.ClearField("max_queue_delay_microseconds")
            cfg.dynamic_batching.ClearField("preferred_batch_size")
        assert after == before
    finally:
        with grpcclient.InferenceServerClient(user_server.grpc_url) as c:
            for name in (MODEL, ENCODER):
                c.load_model(name, config=json.dumps(original[name]),
                             headers={"triton-grpc-protocol-triton-admin-key": KEY})


def test_sigterm_in_the_middle_restores_both_served_configs(user_server, workdir: Path) -> None:
    before = configs(user_server)
    proc = subprocess.Popen(command("tune", "pair", *target_flags(user_server), *SMALL, "--no-served",
                                    "--delays-us", "2345", "--preferred", "none", "--max-in-flight", "2",
                                    "--rates", "4", "--duration", "120", "--out", "pair"),
                            cwd=workdir, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # progress, not time: wait until the candidate's text endpoint is the served one, then stop the tuner
        with grpcclient.InferenceServerClient(user_server.grpc_url) as c:
            while proc.poll() is None and c.get_model_config(MODEL).config.parameters["max_in_flight"] \
                    .string_value != "2":
                threading.Event().wait(0.2)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output[-3000:]
    assert f"restored the served config of {MODEL}" in output and f"of {ENCODER}" in output
    assert configs(user_server) == before
