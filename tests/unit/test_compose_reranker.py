"""The compose exporter's command as docker-compose renders it, run by sh with a `bge-triton` that records its
arguments: one `bge-triton export` of the embedder, a second of the reranker only when RERANK_MODEL is set (both
--skip-existing, the GPU or the CPU file's precision and instance kind); the gateway serves the reranker on the
same setting (deploy/gateway-entrypoint.sh, run with a `python` that records its arguments); and Triton's
readiness checks the reranker only where the repository holds it (deploy/verify-ready.sh)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from tests.unit.test_compose_file import COMPOSE, CPU, GPU, _compose_env, _config, needs_compose

REPO = Path(__file__).resolve().parents[2]
RECORDER = '#!/bin/sh\nprintf "%s\\n" "$(basename "$0") $*" >>"$RECORD"\n'


def _rendered(tmp_path: Path, files: tuple[Path, ...], **env: str) -> dict:
    env_file = tmp_path / "empty.env"
    env_file.write_text("")
    proc = _config(env_file=env_file, env=_compose_env(**env), files=files)
    assert proc.returncode == 0 and "variable is not set" not in proc.stderr, proc.stderr
    return yaml.safe_load(proc.stdout)["services"]


def _recorders(tmp_path: Path, *names: str) -> tuple[dict[str, str], Path]:
    bin_dir, record = tmp_path / "bin", tmp_path / "record.txt"
    bin_dir.mkdir(exist_ok=True)
    for name in names:
        (bin_dir / name).write_text(RECORDER)
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(record)}, record


def _run_exporter(tmp_path: Path, files: tuple[Path, ...], **env: str) -> list[list[str]]:
    exporter = _rendered(tmp_path, files, **env)["exporter"]
    run_env, record = _recorders(tmp_path, "bge-triton")
    run_env.update({k: "" if v is None else str(v) for k, v in exporter["environment"].items()})
    # `config` prints the file's $$ (compose's escape of a $ for the container) as it stands; compose runs it as $
    command = [arg.replace("$$", "$") for arg in exporter["command"]]
    proc = subprocess.run(command, env=run_env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return [line.split() for line in record.read_text().splitlines()] if record.exists() else []


def _flags(argv: list[str]) -> dict[str, str]:
    assert argv[:2] == ["bge-triton", "export"] and "--skip-existing" in argv, argv
    rest = [a for a in argv[2:] if a != "--skip-existing"]
    return dict(zip(rest[::2], rest[1::2], strict=True))


@needs_compose
def test_exporter_exports_the_embedder_only_by_default(tmp_path: Path) -> None:
    (embed,) = _run_exporter(tmp_path, (COMPOSE, GPU))
    assert _flags(embed) == {"--model-id": "BAAI/bge-large-zh-v1.5", "--repository": "/models",
                             "--model": "bge_large_zh", "--precision": "fp16", "--instance-kind": "gpu"}


@needs_compose
@pytest.mark.parametrize(("files", "precision", "kind"),
                         [((COMPOSE, GPU), "fp16", "gpu"), ((COMPOSE, CPU), "fp32", "cpu")])
def test_rerank_model_adds_a_second_export(tmp_path: Path, files: tuple[Path, ...], precision: str, kind: str) -> None:
    embed, rerank = _run_exporter(tmp_path, files, RERANK_MODEL="BAAI/bge-reranker-large")
    assert _flags(embed)["--model"] == "bge_large_zh" and _flags(embed)["--precision"] == precision
    assert _flags(rerank) == {"--task": "rerank", "--model-id": "BAAI/bge-reranker-large", "--repository": "/models",
                              "--model": "bge_reranker", "--precision": precision, "--instance-kind": kind}
    (tmp_path / "int8").mkdir()
    (_, rerank_int8) = _run_exporter(tmp_path / "int8", files, RERANK_MODEL="synthetic:bge-reranker-small",
                                     RERANK_PRECISION="int8")
    assert _flags(rerank_int8)["--precision"] == "int8" and _flags(rerank_int8)["--model-id"].startswith("synthetic:")


def _run_gateway_entrypoint(tmp_path: Path, **env: str) -> list[str]:
    gateway = _rendered(tmp_path, (COMPOSE, GPU), **env)["gateway"]
    run_env, record = _recorders(tmp_path, "python")
    record.unlink(missing_ok=True)
    run_env.update({k: "" if v is None else str(v) for k, v in gateway["environment"].items()})
    run_env["SECRETS_DIR"] = str(tmp_path / "secrets")
    entry = REPO / "deploy" / "gateway-entrypoint.sh"
    proc = subprocess.run(["sh", str(entry), *gateway["command"]], env=run_env, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    (line,) = record.read_text().splitlines()
    return line.split()


@needs_compose
def test_gateway_serves_the_reranker_on_the_same_setting(tmp_path: Path) -> None:
    off = _run_gateway_entrypoint(tmp_path)
    assert off[:3] == ["python", "-m", "bge_triton.gateway"] and not [a for a in off if a.startswith("--rerank")]
    on = _run_gateway_entrypoint(tmp_path, RERANK_MODEL="BAAI/bge-reranker-large")
    assert on == [*off, "--rerank-model=bge_reranker"]


def test_readiness_checks_the_reranker_only_where_the_repository_holds_it(tmp_path: Path) -> None:
    """verify-ready.sh with recording check scripts: the reranker's runs after the embedder's pass, only when
    <repository>/bge_reranker exists, once (its pass remembered), and its failure fails the probe."""
    if shutil.which("sh") is None:
        pytest.skip("no sh")
    record = tmp_path / "record.txt"
    scripts = {}
    for name, code in (("embed", 0), ("rerank", 0)):
        scripts[name] = tmp_path / f"{name}.py"
        rc_file = tmp_path / f"{name}.rc"
        scripts[name].write_text(f"import sys\nopen({str(record)!r}, 'a').write({name!r} + ' ' + ' '.join(sys.argv[1:])"
                                 f" + '\\n')\nsys.exit(int(open({str(rc_file)!r}).read()))\n")
        (tmp_path / f"{name}.rc").write_text(str(code))
    repo = tmp_path / "models"
    (repo / "bge_large_zh").mkdir(parents=True)
    env = {**os.environ, "VERIFY_SCRIPT": str(scripts["embed"]), "VERIFY_RERANK_SCRIPT": str(scripts["rerank"]),
           "VERIFY_REPOSITORY": str(repo), "VERIFY_STATE_DIR": str(tmp_path / "state"), "VERIFY_LOG": "",
           "VERIFY_PYTHON": shutil.which("python3") or "python3"}

    def probe(*args: str) -> int:
        return subprocess.run(["sh", str(REPO / "deploy" / "verify-ready.sh"), *args], env=env,
                              capture_output=True, text=True, timeout=30).returncode

    def calls() -> list[str]:
        lines = record.read_text().splitlines() if record.exists() else []
        record.unlink(missing_ok=True)
        return [line.split()[0] for line in lines]

    assert probe() == 0 and calls() == ["embed"]  # no reranker in the repository: not checked
    (repo / "bge_reranker").mkdir()
    (repo / "bge_reranker" / "config.pbtxt").write_text('name: "bge_reranker"\n')
    (tmp_path / "rerank.rc").write_text("1")
    assert probe() == 1 and calls() == ["embed", "rerank"]  # off its reference: not ready
    (tmp_path / "rerank.rc").write_text("0")
    assert probe() == 0 and calls() == ["embed", "rerank"]
    assert probe() == 0 and calls() == ["embed"]  # the pass is remembered
    assert probe("--marker-only") == 0 and calls() == ["embed"]  # the embedder's script reads its own marker
    (tmp_path / "embed.rc").write_text("1")
    assert probe() == 1 and calls() == ["embed"]  # the embedder first
