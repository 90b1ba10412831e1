"""`bge-triton verify` and the readiness check against a REAL local tritonserver serving the MiniLM export.

A served export verifies (HTTP and gRPC, the stdlib check, `serve status`); an export whose encoder weights were
perturbed fails and stays not ready; a repository whose tokenizer belongs to another model fails with a message
that points at the tokenizer.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from bge_triton.verify import check

REPO_ROOT = Path(__file__).resolve().parents[2]
READY_SH = REPO_ROOT / "deploy" / "verify-ready.sh"
NAME, ENCODER = "minilm", "minilm_onnx"


def verify_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bge_triton.cli", "verify", "--model", NAME, *args],
                          capture_output=True, text=True, timeout=300)


def ready_sh(srv, repository: Path, state: Path, *args: str) -> subprocess.CompletedProcess:
    """deploy/verify-ready.sh as the healthcheck runs it (python3 from PATH, here the test's interpreter)."""
    env = {**os.environ, "VERIFY_URL": f"http://{srv.http_url}", "VERIFY_MODEL": NAME,
           "VERIFY_REPOSITORY": str(repository), "VERIFY_STATE_DIR": str(state), "VERIFY_LOG": str(state / "log"),
           "VERIFY_PYTHON": sys.executable, "VERIFY_TIMEOUT_S": "120"}
    return subprocess.run(["sh", str(READY_SH), *args], capture_output=True, text=True, timeout=300, env=env)


def copy_repo(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=False)
    return dst


def test_served_export_verifies(minilm_repo: Path, triton_server, tmp_path: Path) -> None:
    ref = json.loads((minilm_repo / ENCODER / "1" / "reference.json").read_text())
    assert ref["precision"] == "fp32" and len(ref["probes"]) >= 10
    http = verify_cli("--url", f"http://{triton_server.http_url}", "--repository", str(minilm_repo))
    assert http.returncode == 0, http.stdout + http.stderr
    assert "verify OK: model minilm (encoder minilm_onnx, fp32" in http.stdout
    for probe in ref["probes"]:  # one line per probe, both paths near 1 for fp32 on CPU
        line = next(x for x in http.stdout.splitlines() if x.startswith(probe["name"] + " "))
        text_cos, enc_cos = (float(v) for v in line.split()[-3:-1])
        assert text_cos >= 0.9999 and enc_cos >= 0.9999, line
    grpc = verify_cli("--url", f"grpc://{triton_server.grpc_url}", "--reference",
                      str(minilm_repo / ENCODER / "1" / "reference.json"))
    assert grpc.returncode == 0 and "verify OK" in grpc.stdout, grpc.stdout + grpc.stderr
    result = check(triton_server.http_url, NAME, repository=minilm_repo)
    assert result.ok and result.fault == "" and min(p.encoder_cosine for p in result.probes) >= 0.9999
    ready = ready_sh(triton_server, minilm_repo, tmp_path / "state")
    assert ready.returncode == 0 and "verify OK" in ready.stdout, ready.stdout + ready.stderr
    assert (tmp_path / "state" / f"{NAME}.ok").is_file()
    marker_only = tmp_path / "marker_only"  # the entrypoint's check at start, probes that never embed
    first = ready_sh(triton_server, minilm_repo, marker_only, "--marker-only")
    assert first.returncode == 1 and "not verified yet" in first.stderr, first.stderr
    at_start = ready_sh(triton_server, minilm_repo, marker_only, "--wait", "60")
    assert at_start.returncode == 0 and "verify OK" in at_start.stdout, at_start.stdout + at_start.stderr
    assert ready_sh(triton_server, minilm_repo, marker_only, "--marker-only").returncode == 0
    status = subprocess.run([sys.executable, "-m", "bge_triton.server", "status", "--state-dir",
                             str(triton_server.state)], capture_output=True, text=True, timeout=120)
    assert status.returncode == 0 and f"{NAME}: verify OK" in status.stdout, status.stdout + status.stderr


def perturb_largest_matmul_weight(model_path: Path, scale: float = 0.5) -> str:
    """Add seeded noise (scale x the weight's own std) to the largest float MatMul weight of the graph."""
    model = onnx.load(str(model_path))
    matmul_inputs = {i for n in model.graph.node if n.op_type == "MatMul" for i in n.input}
    candidates = [t for t in model.graph.initializer
                  if t.name in matmul_inputs and t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2]
    target = max(candidates, key=lambda t: int(np.prod(t.dims)))
    w = numpy_helper.to_array(target)
    noisy = w + np.random.default_rng(0).normal(scale=scale * w.std(), size=w.shape).astype(w.dtype)
    target.CopyFrom(numpy_helper.from_array(noisy, target.name))
    onnx.save(model, str(model_path))
    return target.name


def test_corrupted_encoder_fails_verify_and_stays_not_ready(minilm_repo: Path, server_factory, tmp_path: Path) -> None:
    repo = copy_repo(minilm_repo, tmp_path / "corrupt")
    perturb_largest_matmul_weight(repo / ENCODER / "1" / "model.onnx")
    srv = server_factory(repo)
    proc = verify_cli("--url", f"http://{srv.http_url}", "--repository", str(repo))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    for part in ("verify FAILED", "model minilm", "fp32", "worst probe", "through the encoder with the exporter's "
                 "tokens", "encoder's numbers are not the reference's"):
        assert part in message, (part, message)
    assert "TOKENIZER" not in message
    state = tmp_path / "state"
    for _ in range(2):  # not ready at every probe, not only the first
        ready = ready_sh(srv, repo, state)
        assert ready.returncode == 1, ready.stdout + ready.stderr
        assert ready.stderr.strip() == message  # the same message as `bge-triton verify`
    assert not (state / f"{NAME}.ok").exists()
    assert json.loads((state / f"{NAME}.failed").read_text())["message"] == message
    assert (state / "log").read_text().count(message) == 1


def test_foreign_tokenizer_fails_verify_pointing_at_the_tokenizer(minilm_repo: Path, server_factory,
                                                                   tmp_path: Path) -> None:
    """The text endpoint loads the synthetic bge-small-zh tokenizer (another vocab) in front of the right encoder."""
    from bge_triton.export.synthetic import write_tokenizer

    repo = copy_repo(minilm_repo, tmp_path / "foreign")
    tok = repo / NAME / "1" / "tokenizer"
    shutil.rmtree(tok)
    tok.mkdir()
    write_tokenizer(tok, 256)
    srv = server_factory(repo)
    proc = verify_cli("--url", f"http://{srv.http_url}", "--repository", str(repo))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    assert "TOKENIZER does not match the export" in message and "minilm/1/tokenizer/" in message, message
    assert "token counts differ" in message and "encoder given the exporter's tokens holds" in message, message
    ready = ready_sh(srv, repo, tmp_path / "state")
    assert ready.returncode == 1 and ready.stderr.strip() == message


def test_missing_reference_is_not_ready_and_says_how_to_fix(minilm_repo: Path, triton_server, tmp_path: Path) -> None:
    empty = tmp_path / "no_export"
    empty.mkdir()
    proc = verify_cli("--url", f"http://{triton_server.http_url}", "--repository", str(empty))
    assert proc.returncode == 2 and "no reference vectors at" in proc.stderr and "bge-triton export" in proc.stderr
    ready = ready_sh(triton_server, empty, tmp_path / "state")
    assert ready.returncode == 1 and "verify could not run" in ready.stderr


def test_probes_reach_what_the_tokenizer_treats_specially(minilm_repo: Path) -> None:
    """Special-token strings inside a text and unknown characters are probed, so a served tokenizer that differs
    there is caught: MiniLM's tokenizer maps the literal [SEP] in the text to id 102 and emoji to [UNK] (100)."""
    ref = json.loads((minilm_repo / ENCODER / "1" / "reference.json").read_text())
    probes = {p["name"]: p for p in ref["probes"]}
    assert probes["special_tokens"]["input_ids"][1:-1].count(102) >= 1
    assert 100 in probes["unknown"]["input_ids"]
    assert len(probes["zh_long"]["input_ids"]) == len(probes["en_long"]["input_ids"]) == ref["max_length"]
