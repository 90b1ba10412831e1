"""The gateway's --reference against the REAL local tritonserver (session fixture, the MiniLM export and the
reference.json its exporter wrote): ready once the served model reproduces the reference; kept at 503 naming
the worst probe when the reference's vectors were perturbed, the failure logged as `bge-triton verify` says it."""
from __future__ import annotations

import base64
import json
import re
import time
from pathlib import Path
from typing import Any

import httpx as httpx
import numpy as np
import pytest
import starlette  # noqa: F401 - the extra this test needs
from test_gateway_openai import NAME, start

pytestmark = pytest.mark.integration


def reference_of(repo: Path) -> Path:
    path = repo / f"{NAME}_onnx" / "1" / "reference.json"  # written by `bge-triton export` beside model.onnx
    assert path.is_file(), f"the export wrote no {path}"
    return path


def test_the_gateway_is_ready_once_the_served_model_verifies(triton_server: Any, minilm_repo: Path,
                                                             tmp_path: Path) -> None:
    proc = start(tmp_path, triton_server.grpc_url, None, "--reference", str(reference_of(minilm_repo)))
    try:
        r = httpx.get(proc.url + "/ready", timeout=10)
        assert r.status_code == 200 and r.json() == {"status": "ready", "model": NAME}
        assert "gateway_verified 1.0" in httpx.get(proc.url + "/metrics", timeout=10).text
        assert f"verify OK: model {NAME} (encoder {NAME}_onnx, fp32" in proc.log_text()
    finally:
        proc.stop()


def perturbed(reference: Path, out: Path, probe: int, rng: np.random.Generator) -> tuple[str, float]:
    """A copy of reference.json whose probe PROBE points elsewhere (cosine about 0.89 with the original);
    the probe's name and that cosine."""
    doc = json.loads(reference.read_text(encoding="utf-8"))
    entry = doc["probes"][probe]
    v = np.frombuffer(base64.b64decode(entry["vector"]), dtype="<f4").astype(np.float64)
    noise = rng.standard_normal(v.shape)
    noise -= noise @ v / (v @ v) * v  # orthogonal to v
    w = v / np.linalg.norm(v) + 0.5 * noise / np.linalg.norm(noise)
    w /= np.linalg.norm(w)
    entry["vector"] = base64.b64encode(w.astype("<f4").tobytes()).decode("ascii")
    out.write_text(json.dumps(doc), encoding="utf-8")
    return entry["name"], float(w @ v / np.linalg.norm(v))


def test_a_reference_that_does_not_hold_keeps_ready_503_naming_the_worst_probe(
        triton_server: Any, minilm_repo: Path, tmp_path: Path) -> None:
    bad = tmp_path / "perturbed" / "reference.json"
    bad.parent.mkdir()
    name, cosine = perturbed(reference_of(minilm_repo), bad, probe=2, rng=np.random.default_rng(23))
    assert 0.85 < cosine < 0.95
    proc = start(tmp_path, triton_server.grpc_url, None, "--reference", str(bad), wait="/health")
    try:
        deadline = time.monotonic() + 180  # the canary, then 13 probes both ways on a busy CPU
        while True:
            r = httpx.get(proc.url + "/ready", timeout=10)
            assert r.status_code == 503, r.text  # never ready, not even before the first verdict
            if "verify FAILED" in r.json()["error"]:
                break
            assert time.monotonic() < deadline, f"no verdict within 180 s: {r.text}\n{proc.log_text()}"
            time.sleep(0.5)
        error = r.json()["error"]
        worst = re.search(r"with the exporter's tokens, worst probe '([^']+)' cosine ([0-9.]+)", error)
        assert worst and worst[1] == name and abs(float(worst[2]) - cosine) < 1e-3, error  # the perturbed probe
        assert str(tmp_path) not in r.text and triton_server.grpc_url not in r.text
        assert r.headers["retry-after"]
        log = proc.log_text()
        assert error.replace("reference.json", str(bad)) in log  # the same message verify prints, path included
        assert "gateway_verified 0.0" in httpx.get(proc.url + "/metrics", timeout=10).text
        assert httpx.get(proc.url + "/ready", timeout=10).status_code == 503  # it stays so
        assert httpx.get(proc.url + "/health", timeout=10).status_code == 200  # the process itself is fine
    finally:
        proc.stop()


def test_another_model_behind_the_same_address_is_verified_again(minilm_repo: Path, tmp_path: Path) -> None:
    """Triton goes away and comes back on the same port serving an encoder whose weights were perturbed: the
    gateway, ready before, checks again and stays 503 naming the encoder, never 200 in between."""
    from test_verify_served import copy_repo, perturb_largest_matmul_weight

    from bge_triton.server.launcher import LocalServer, ServerSettings
    from conftest import free_port

    bad_repo = copy_repo(minilm_repo, tmp_path / "corrupt")
    perturb_largest_matmul_weight(bad_repo / f"{NAME}_onnx" / "1" / "model.onnx")
    ports = {"http_port": free_port(), "grpc_port": free_port(), "metrics_port": free_port()}
    servers = [LocalServer(ServerSettings(repository=minilm_repo, state_dir=tmp_path / "a", **ports)).start()]
    proc = None
    try:
        proc = start(tmp_path, servers[0].grpc_url, None, "--reference", str(reference_of(minilm_repo)),
                     "--canary-interval", "0.5", "--ready-max-age", "2")
        assert "gateway_verified 1.0" in httpx.get(proc.url + "/metrics", timeout=10).text
        servers[0].stop()
        deadline = time.monotonic() + 120
        while httpx.get(proc.url + "/ready", timeout=10).status_code == 200:
            assert time.monotonic() < deadline, "/ready still 200 two minutes after Triton stopped"
            time.sleep(0.2)
        servers.append(LocalServer(ServerSettings(repository=bad_repo, state_dir=tmp_path / "b", **ports)).start())
        deadline = time.monotonic() + 180
        while True:
            r = httpx.get(proc.url + "/ready", timeout=10)
            assert r.status_code == 503, r.text  # not ready between Triton's return and the verdict
            if "verify FAILED" in r.json()["error"]:
                break
            assert time.monotonic() < deadline, f"no verdict within 180 s: {r.text}\n{proc.log_text()}"
            time.sleep(0.2)
        assert "through the encoder with the exporter's tokens, worst probe" in r.json()["error"]
        assert "gateway_verified 0.0" in httpx.get(proc.url + "/metrics", timeout=10).text
        log = proc.log.read_text(errors="replace")
        assert log.count("verify OK") == 1 and log.count("verify FAILED") == 1, log[-4000:]
    finally:
        if proc is not None:
            proc.stop()
        for srv in servers:
            srv.stop()
