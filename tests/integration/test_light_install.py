"""`pip install bge-triton-kit` is the client SDK only: build the wheel, install it WITHOUT extras into a fresh
venv, check that the heavy stacks are absent there and that nothing but `bge_triton` lands at the top level of
site-packages, then embed through the real local tritonserver with that venv's SDK."""
from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bge_triton.client import EmbeddingClient

REPO_ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "optimum", "locust", "pytriton", "onnxruntime", "matplotlib", "snownlp", "transformers")
OWN_TOP_LEVEL = ("client", "server", "export", "kit", "loadtest", "gateway", "integrations")
TEXTS = ["The cat sits on the mat.", "这是一个中文句子。", "short"]

PROBE = r"""
import importlib.util, json, sys, sysconfig, os
from bge_triton.client import EmbeddingClient
heavy = {m: importlib.util.find_spec(m) is not None for m in sys.argv[2].split(",")}
site = sysconfig.get_paths()["purelib"]
top = sorted(n for n in os.listdir(site) if not n.endswith((".dist-info", ".pth")) and n != "__pycache__")
try:
    import bge_triton.export
    extra_error = ""
except ImportError as exc:
    extra_error = str(exc)
with EmbeddingClient(sys.argv[1], model="minilm") as client:
    vectors = client.embed_documents(sys.argv[3:])
print(json.dumps({"heavy": heavy, "top": top, "extra_error": extra_error, "vectors": vectors.tolist()}))
"""


def _run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kwargs)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def light_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with only the kit's wheel and its base dependencies (pinned by the lock)."""
    root = tmp_path_factory.mktemp("light")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(root / "dist"),
          str(REPO_ROOT)])
    wheels = list((root / "dist").glob("bge_triton_kit-*.whl"))
    assert len(wheels) == 1, wheels
    venv.EnvBuilder(with_pip=True).create(root / "venv")
    python = root / "venv" / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "--quiet", "-c", str(REPO_ROOT / "requirements.lock"),
          str(wheels[0])])
    return python


def test_sdk_only_install_embeds_through_the_real_server(light_venv: Path, triton_server: Any) -> None:
    proc = _run([str(light_venv), "-c", PROBE, triton_server.grpc_url, ",".join(HEAVY), *TEXTS], cwd="/")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not any(out["heavy"].values()), f"heavy packages in the SDK-only install: {out['heavy']}"
    assert "bge_triton" in out["top"]
    assert not set(out["top"]) & set(OWN_TOP_LEVEL), f"kit folders at the top of site-packages: {out['top']}"
    assert "bge-triton-kit[export]" in out["extra_error"], out["extra_error"]
    with EmbeddingClient(triton_server.grpc_url, model="minilm") as client:  # the dev venv's SDK, same server
        reference = client.embed_documents(TEXTS)
    vectors = np.asarray(out["vectors"], dtype=np.float32)
    assert vectors.shape == reference.shape == (len(TEXTS), 384)
    np.testing.assert_allclose(vectors, reference, atol=1e-5)


def test_the_checkout_cannot_shadow_the_installed_wheel(light_venv: Path) -> None:
    """Run from the checkout's root (a Docker WORKDIR holding the sources): the import resolves to the wheel in the
    venv, and a subpackage whose extra is missing says which extra, instead of a ModuleNotFoundError."""
    probe = ("import json, bge_triton, bge_triton.client\n"
             "try:\n    import bge_triton.gateway\n    err = ''\nexcept ImportError as exc:\n    err = str(exc)\n"
             "print(json.dumps({'file': bge_triton.__file__, 'client': bge_triton.client.__file__, 'err': err}))")
    proc = _run([str(light_venv), "-c", probe], cwd=REPO_ROOT)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    venv_root = str(light_venv.parent.parent)
    assert out["file"].startswith(venv_root) and out["client"].startswith(venv_root), out
    assert "bge-triton-kit[gateway]" in out["err"], out["err"]
