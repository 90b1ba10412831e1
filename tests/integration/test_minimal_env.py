"""The text endpoint served the way the server image runs it: the python stubs see numpy and the image's pip
list (deploy/Dockerfile.server) only, no kit, no torch, no onnxruntime. The shipped model_repository (configs
and model.py as committed) with a generated BGE-shaped vocab, the encoder on the cost model; a probe model in
the same server reports what its stub can import."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from bge_triton.client import EmbeddingClient
from bge_triton.server.cpu_variant import CpuVariant
from bge_triton.server.launcher import LocalServer, ServerSettings, free_ports

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("server_image", REPO / "deploy" / "server_image.py")
server_image = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(server_image)

NAME = "bge_large_zh"
FORBIDDEN = ("torch", "onnxruntime", "onnx", "bge_triton", "tritonclient", "transformers", "huggingface_hub")
PROBE = '''
import importlib.util, json, sys
import numpy as np
import tokenizers
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        names = json.loads(pb_utils.get_input_tensor_by_name(requests[0], "names").as_numpy()[0].decode())
        report = {"found": {n: importlib.util.find_spec(n) is not None for n in names}, "sys_path": sys.path,
                  "numpy": np.__version__, "tokenizers": tokenizers.__version__}
        out = np.array([json.dumps(report).encode()], dtype=object)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("report", out)]) for _ in requests]
'''


def lock_pin(name: str) -> str:
    """The `name==version` line of requirements.lock."""
    (line,) = [ln.strip() for ln in (REPO / "requirements.lock").read_text().splitlines()
               if ln.lower().startswith(f"{name}==")]
    return line


def stub_packages() -> tuple[str, ...]:
    """What the server image's Python holds for the models: numpy (NGC's own) + deploy/Dockerfile.server's pip list."""
    return (lock_pin("numpy"), *server_image.image_packages())


def write_tokenizer(dst: Path) -> None:
    """A BERT WordPiece tokenizer.json over the BGE-shaped generated vocab (each CJK character one token)."""
    from tokenizers.implementations import BertWordPieceTokenizer

    from bge_triton.export.synthetic import build_vocab

    vocab = {token: i for i, token in enumerate(build_vocab())}
    dst.mkdir(parents=True)
    BertWordPieceTokenizer(vocab, lowercase=True, handle_chinese_chars=True).save(str(dst / "tokenizer.json"))


def write_probe(repo: Path) -> None:
    """A python model that reports which modules its stub can import, and its sys.path."""
    cfg = mc.ModelConfig(name="probe", backend="python", max_batch_size=0)
    cfg.input.add(name="names", data_type=mc.TYPE_STRING, dims=[1])
    cfg.output.add(name="report", data_type=mc.TYPE_STRING, dims=[1])
    cfg.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)
    (repo / "probe" / "1").mkdir(parents=True)
    (repo / "probe" / "config.pbtxt").write_text(text_format.MessageToString(cfg))
    (repo / "probe" / "1" / "model.py").write_text(PROBE)


def entrypoint_flags(tmp: Path) -> tuple[str, ...]:
    """The flags deploy/triton-entrypoint.sh appends to `tritonserver` (key generated into tmp/secrets)."""
    fake = tmp / "bin" / "tritonserver"
    fake.parent.mkdir(parents=True)
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    out = subprocess.run(["sh", str(REPO / "deploy" / "triton-entrypoint.sh"), "tritonserver"], check=True,
                         capture_output=True, text=True, env={"PATH": f"{fake.parent}:/usr/bin:/bin",
                                                              "SECRETS_DIR": str(tmp / "secrets")})
    return tuple(out.stdout.splitlines())


@pytest.fixture(scope="module")
def minimal_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    repo = tmp_path_factory.mktemp("shipped_repo")
    for model in (NAME, f"{NAME}_onnx"):  # the committed configs and python files, unchanged
        shutil.copytree(REPO / "src" / "bge_triton" / "model_repository" / model, repo / model,
                        ignore=shutil.ignore_patterns("tokenizer", "*.onnx*", "export_report.json", "__pycache__"))
    write_tokenizer(repo / NAME / "1" / "tokenizer")
    write_probe(repo)
    secrets = tmp_path_factory.mktemp("entrypoint")
    flags = entrypoint_flags(secrets)
    http, grpc, metrics = free_ports(3)
    settings = ServerSettings(repository=repo, http_port=http, grpc_port=grpc, metrics_port=metrics,
                              state_dir=tmp_path_factory.mktemp("minimal_env_state"), ready_timeout_s=300,
                              variant=CpuVariant(executor="costmodel"), stub_packages=stub_packages(),
                              extra_args=flags)
    with LocalServer(settings) as srv:
        srv.admin_key = (secrets / "secrets" / "admin_key").read_text()
        yield srv


def _post(srv: LocalServer, model: str, body: dict) -> dict:
    return _request(srv, f"/v2/models/{model}/infer", body)


def _request(srv: LocalServer, path: str, body: dict, **headers: str) -> dict:
    req = urllib.request.Request(f"http://{srv.http_url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_entrypoint_flags_close_the_admin_apis_only(minimal_server: LocalServer) -> None:
    with pytest.raises(urllib.error.HTTPError) as closed:
        _request(minimal_server, "/v2/repository/index", {})
    assert closed.value.code == 403 and "triton-admin-key" in closed.value.read().decode()
    index = _request(minimal_server, "/v2/repository/index", {}, **{"triton-admin-key": minimal_server.admin_key})
    assert {m["name"] for m in index} >= {NAME, f"{NAME}_onnx"}


def test_stub_sees_numpy_and_the_image_packages_only(minimal_server: LocalServer) -> None:
    names = [*FORBIDDEN, "numpy", "tokenizers"]
    out = _post(minimal_server, "probe", {"inputs": [{"name": "names", "shape": [1], "datatype": "BYTES",
                                                      "data": [json.dumps(names)]}]})
    report = json.loads(out["outputs"][0]["data"][0])
    assert {n: report["found"][n] for n in FORBIDDEN} == {n: False for n in FORBIDDEN}, report["sys_path"]
    assert report["found"]["numpy"] and report["found"]["tokenizers"]
    assert f"numpy=={report['numpy']}" in stub_packages()
    assert f"tokenizers=={report['tokenizers']}" in stub_packages()
    site = [p for p in report["sys_path"] if p.endswith(("site-packages", "dist-packages"))]
    assert len(site) == 1 and site[0].startswith(str(REPO / ".kit" / "cache" / "stub-venv-")), report["sys_path"]
    assert not [p for p in report["sys_path"] if p.rstrip("/") == str(REPO)], report["sys_path"]


def test_text_embeds_through_the_text_endpoint(minimal_server: LocalServer) -> None:
    # the HTTP request of docs/gpu.md's quickstart
    out = _post(minimal_server, NAME, {"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES",
                                                   "data": ["今天天气很好"]}]})
    outputs = {o["name"]: o for o in out["outputs"]}
    emb = outputs["embedding"]
    # no outputs named: Triton answers every output, the text endpoint's timing_us included
    assert sorted(outputs) == ["embedding", "timing_us", "token_count"] and emb["shape"] == [1, 1024]
    assert outputs["timing_us"]["shape"] == [1, 3] and min(outputs["timing_us"]["data"]) >= 0
    assert outputs["token_count"]["shape"] == [1, 1] and outputs["token_count"]["data"][0] >= 3  # [CLS] .. [SEP]
    assert abs(float(np.linalg.norm(np.asarray(emb["data"], dtype=np.float32))) - 1.0) < 1e-3
    with EmbeddingClient(minimal_server.grpc_url, model=NAME) as client:
        vecs = client.embed_documents(["检索增强生成", "向量数据库里的一段很长的文本" * 20])
        query = client.embed_queries(["明天天气怎么样"])  # docs/gpu.md's SDK example
    assert vecs.shape == (2, 1024) and query.shape == (1, 1024)
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-3)
