"""deploy/k8s/components/reranker rendered on the gpu overlay with `kubectl kustomize`: the reranker's export runs
after the embedder's into the same repository with compose's RERANK_MODEL command (the component's default model),
the kit image as the overlay names it, and the gateway serves /rerank; without the component nothing of it."""
from __future__ import annotations

import os

import pytest
import yaml
from tests.unit.test_k8s_manifests import K8S, REPO, _flags, cm, container, one

pytestmark = pytest.mark.skipif(cm.kubectl() is None, reason="kubectl absent: install kubectl >= 1.27")


@pytest.fixture(scope="module")
def with_reranker(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    overlay = tmp_path_factory.mktemp("overlay")
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "overlays" / "gpu", overlay)],
        "components": [os.path.relpath(K8S / "components" / "reranker", overlay)]}))
    return cm.render(overlay)


def _compose_rerank_flags() -> set[tuple[str, str]]:
    """The compose exporter script's reranker export, RERANK_MODEL=BAAI/bge-reranker-large, other defaults."""
    import shlex

    exporter = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["exporter"]
    script = exporter["command"][2].replace("\\\n", " ").replace("$$", "$")
    (line,) = [ln.strip() for ln in script.splitlines() if "--task rerank" in ln]
    env = {"RERANK_MODEL": "BAAI/bge-reranker-large", "RERANK_PRECISION": "fp16", "INSTANCE_KIND": "gpu"}
    argv = [env.get(a.lstrip("$"), a) for a in shlex.split(line)]
    assert argv[:2] == ["bge-triton", "export"], line
    return _flags(argv[2:])


def test_component_adds_the_reranker_export_after_the_embedders(with_reranker: list[dict]) -> None:
    assert len(cm.validate(with_reranker)) == len(with_reranker)
    triton = one(with_reranker, "Deployment", "triton")
    names = [c["name"] for c in triton["spec"]["template"]["spec"]["initContainers"]]
    assert names == ["export", "export-reranker"]  # in order: the embedder first
    export, rerank = container(triton, "export", init=True), container(triton, "export-reranker", init=True)
    assert rerank["image"] == export["image"] and rerank["image"].startswith("bge-triton-kit:")
    assert rerank["volumeMounts"] == export["volumeMounts"] and rerank["securityContext"] == export["securityContext"]
    assert rerank["command"][:2] == ["bge-triton", "export"]
    ours = _flags(rerank["command"][2:])
    assert ("--cache-dir", "/export-cache") in ours
    assert ours - {("--cache-dir", "/export-cache")} == _compose_rerank_flags()
    # Triton loads what the repository holds; the startup probe checks the reranker where the repository has it
    server = container(triton, "triton")
    assert "--load-model=*" in server["args"]
    assert server["startupProbe"]["exec"]["command"] == ["sh", "/opt/bge-triton/verify-ready.sh"]


def test_gateway_serves_the_reranker_only_with_the_component(with_reranker: list[dict]) -> None:
    args = container(one(with_reranker, "Deployment", "gateway"), "gateway")["args"]
    assert args[args.index("--rerank-model") + 1] == "bge_reranker"
    plain = cm.render(K8S / "overlays" / "gpu")
    assert "--rerank-model" not in container(one(plain, "Deployment", "gateway"), "gateway")["args"]
    assert [c["name"] for c in one(plain, "Deployment", "triton")["spec"]["template"]["spec"]["initContainers"]] \
        == ["export"]
