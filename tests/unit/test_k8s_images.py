"""deploy/build-images.sh with docker or podman, run against a fake engine that records its calls: what it builds,
with which engine's flags, and what `--push REGISTRY` tags, pushes and prints (the `images:` block of the overlay in
docs/k8s.md's step 2, which must move every image of the Kustomize trees)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "build-images.sh"
FAKE = """#!/bin/sh
echo "$0 $*" >> "$ENGINE_LOG"
case "$1 $2" in
  "image inspect") case "$*" in *Size*) echo 1000000 ;; *) echo sha256:fake ;; esac ;;
esac
exit 0
"""


def run_script(tmp_path: Path, engine: str, *args: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """build-images.sh ARGS with ENGINE=engine, a fake `engine` first on PATH; (the run, the engine's calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / engine
    fake.write_text(FAKE)
    fake.chmod(0o755)
    log = tmp_path / f"{engine}.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ENGINE": engine, "ENGINE_LOG": str(log),
           "BUILD_CONTEXT_DIR": str(tmp_path / "ctx"), "TORCH_WHEELS": "", "PUSH_TAG": ""}
    proc = subprocess.run(["bash", str(SCRIPT), "--worktree", *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=REPO)
    calls = [line.split(" ", 1)[1] for line in log.read_text().splitlines()] if log.exists() else []
    return proc, calls


VERSION = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M).group(1)
NAMES = ["bge-triton-server", "bge-triton-gateway", "bge-triton-kit", "bge-triton-loadtest"]


@pytest.mark.skipif(shutil.which("git") is None or shutil.which("flock") is None, reason="needs git and flock")
def test_docker_builds_tags_pushes_and_prints_the_overlays_images(tmp_path: Path) -> None:
    proc, calls = run_script(tmp_path, "docker", "--push", "registry.example.com/bge/")
    assert proc.returncode == 0, proc.stderr[-2000:]
    builds = [c for c in calls if c.startswith("build ")]
    assert [re.search(r"-t (\S+)", b).group(1) for b in builds] == [f"{n}:local" for n in NAMES]
    # docker's build: no podman-only flags (--pull=never, --layers, -v); the Dockerfiles' default bases
    assert not [b for b in builds if "--pull=never" in b or "--layers" in b or " -v " in b]
    assert "--target exporter" in builds[2] and "--target loadtest" in builds[3]
    remote = [f"registry.example.com/bge/{n}:{VERSION}" for n in NAMES]
    tags = [f"tag {n}:local {r}" for n, r in zip(NAMES, remote, strict=True)]
    assert [c for c in calls if c.startswith("tag ")] == tags
    assert [c for c in calls if c.startswith("push ")] == [f"push {r}" for r in remote]
    block = yaml.safe_load(proc.stdout)  # stdout is the overlay's `images:` block only (the log goes to stderr)
    assert block == {"images": [{"name": n, "newName": f"registry.example.com/bge/{n}", "newTag": VERSION}
                                for n in NAMES]}


@pytest.mark.skipif(shutil.which("git") is None or shutil.which("flock") is None, reason="needs git and flock")
def test_podman_builds_offline_and_registry_tags_without_pushing(tmp_path: Path) -> None:
    proc, calls = run_script(tmp_path, "podman", "--registry", "registry.example.com/bge")
    assert proc.returncode == 0, proc.stderr[-2000:]
    builds = [c for c in calls if c.startswith("build ")]
    assert len(builds) == 4 and all("--pull=never --layers" in b for b in builds)
    assert len([c for c in calls if c.startswith("tag ")]) == 4 and not [c for c in calls if c.startswith("push ")]
    assert "newName: registry.example.com/bge/bge-triton-server\n" in proc.stdout


def test_a_push_without_a_registry_says_what_to_give(tmp_path: Path) -> None:
    proc, calls = run_script(tmp_path, "docker", "--push")
    assert proc.returncode == 2 and "--push needs a registry, e.g. --push registry.example.com/bge" in proc.stderr
    assert calls == []
