"""deploy/k8s rendered with `kubectl kustomize`, validated against the Kubernetes schemas, and checked for
what the schemas cannot see: GPU only in the overlay, probes that run the canary, selectors that select,
NetworkPolicies that expose only the gateway, an HPA whose metrics the adapter rules serve."""
from __future__ import annotations

import copy
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tests.deploy.ci import must_run

from bge_triton.loadtest import shapes
from bge_triton.repository import get_param, load_repository

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
_spec = importlib.util.spec_from_file_location("check_manifests", K8S / "check_manifests.py")
cm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cm)
_spec = importlib.util.spec_from_file_location("capacity", K8S / "capacity.py")
capacity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(capacity)

must_run(None if cm.kubectl() else "kubectl absent", "the Kubernetes manifest tests")
pytestmark = pytest.mark.skipif(
    cm.kubectl() is None,
    reason="kubectl absent (on PATH or beside this Python): install kubectl >= 1.27, it bundles kustomize v5")

CONFIGS = load_repository(REPO / "src" / "bge_triton" / "model_repository")
TEXT = next(c for c in CONFIGS.values() if get_param(c, "onnx_model"))  # the text endpoint
ENCODER = CONFIGS[get_param(TEXT, "onnx_model")]
WORKLOADS = {"Deployment", "Job"}


@pytest.fixture(scope="module")
def gpu() -> list[dict]:
    return cm.render(K8S / "overlays" / "gpu")


@pytest.fixture(scope="module")
def monitored() -> list[dict]:
    return cm.render(K8S / "overlays" / "gpu-monitoring")


@pytest.fixture(scope="module")
def base() -> list[dict]:
    return cm.render(K8S / "base")


@pytest.fixture(scope="module")
def loadtest() -> list[dict]:
    return cm.render(K8S / "loadtest")


def one(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(doc: dict, name: str, init: bool = False) -> dict:
    spec = doc["spec"]["template"]["spec"]
    (c,) = [c for c in spec["initContainers" if init else "containers"] if c["name"] == name]
    return c


def containers(doc: dict) -> list[dict]:
    spec = doc["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def env(c: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in c.get("env", [])}


def test_every_resource_is_valid_for_the_kubernetes_schemas(gpu: list[dict], monitored: list[dict],
                                                            loadtest: list[dict]) -> None:
    assert {"Namespace", "ConfigMap", "Service", "Deployment", "PodDisruptionBudget", "HorizontalPodAutoscaler",
            "NetworkPolicy"} <= {d["kind"] for d in gpu}
    for docs in (gpu, monitored, loadtest):
        assert len(cm.validate(docs)) == len(docs)


def test_only_the_monitoring_overlay_needs_the_prometheus_operator(base: list[dict], gpu: list[dict],
                                                                  monitored: list[dict]) -> None:
    """A cluster without the operator's CRDs takes the base and the gpu overlay; gpu-monitoring is gpu + the
    PodMonitors and the PrometheusRule, nothing else changed."""
    for docs in (base, gpu):
        assert not [d["kind"] for d in docs if d["apiVersion"].startswith("monitoring.coreos.com/")]
    crds = [d for d in monitored if d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in crds) == [
        ("PodMonitor", "gateway"), ("PodMonitor", "triton"), ("PrometheusRule", "bge-triton-alerts")]
    assert [d for d in monitored if d not in crds] == gpu
    assert all(d["metadata"]["labels"]["release"] == "prometheus" for d in crds)  # kube-prometheus-stack selects


def test_the_validator_rejects_what_a_cluster_would(gpu: list[dict], monitored: list[dict]) -> None:
    bad = copy.deepcopy(one(gpu, "Deployment", "triton"))
    bad["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # typo of `resources`
    with pytest.raises(cm.ManifestError, match="'resource' was unexpected"):
        cm.validate([bad])
    monitor = copy.deepcopy(one(monitored, "PodMonitor", "triton"))
    monitor["spec"]["podMetricsEndpoints"] = []
    with pytest.raises(cm.ManifestError, match="nothing would be scraped"):
        cm.validate([monitor])
    rule = copy.deepcopy(one(monitored, "PrometheusRule", "bge-triton-alerts"))
    rule["spec"]["groups"][0]["rules"][0]["expr"] = "rate(up[5m]"
    with pytest.raises(cm.ManifestError, match="does not parse"):
        cm.validate([rule])


def test_gpu_is_requested_in_the_overlay_only_and_by_the_server_only(base: list[dict], gpu: list[dict]) -> None:
    """The server asks for one GPU in the overlay; the export runs on the CPU (deploy/Dockerfile.kit: CPU torch)."""
    res = container(one(gpu, "Deployment", "triton"), "triton")["resources"]
    assert res["requests"]["nvidia.com/gpu"] == 1 and res["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in str(container(one(base, "Deployment", "triton"), "triton")["resources"])
    assert "nvidia.com/gpu" not in str(container(one(gpu, "Deployment", "triton"), "export", init=True))
    assert "nvidia.com/gpu" not in str(one(gpu, "Deployment", "gateway"))
    kit = (REPO / "deploy" / "Dockerfile.kit").read_text()
    assert "torch.version.cuda is None" in kit  # the exporter image is the CPU build: a GPU would sit idle


def _flags(argv: list[str]) -> set[tuple[str, str]]:
    """--flag value pairs, a flag without a value (--skip-existing) paired with ''."""
    out, i = set(), 0
    while i < len(argv):
        value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else ""
        out.add((argv[i], value))
        i += 2 if value else 1
    return out


def _compose_export_flags(exporter: dict) -> set[tuple[str, str]]:
    """The flags of the compose exporter script's first `bge-triton export`, its variables at their defaults."""
    env = {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(v)) for k, v in exporter["environment"].items() if v}
    first = exporter["command"][2].replace("\\\n", " ").splitlines()[0]
    argv = [env.get(a.strip('"').lstrip("$"), a) for a in shlex.split(first.replace("$$", "$"))]
    assert argv[:2] == ["bge-triton", "export"], first
    return _flags(argv[2:])


def test_triton_pod_matches_the_compose_deployment(gpu: list[dict]) -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    triton = one(gpu, "Deployment", "triton")
    server, export = container(triton, "triton"), container(triton, "export", init=True)
    assert {p["name"]: p["containerPort"] for p in server["ports"]} == {"http": 8000, "grpc": 8001, "metrics": 8002}
    volumes = {v["name"]: v for v in triton["spec"]["template"]["spec"]["volumes"]}
    (shm,) = [m for m in server["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
    # the exporter: compose's first `bge-triton export` (the embedder) at its defaults, writing the volume Triton
    # reads; plus --cache-dir (compose's root filesystem is writable, the pod's is not)
    assert export["command"][:2] == ["bge-triton", "export"]
    ours = _flags(export["command"][2:])
    assert ("--cache-dir", "/export-cache") in ours
    assert _compose_export_flags(compose["exporter"]) == ours - {("--cache-dir", "/export-cache")}
    (out,) = [m for m in export["volumeMounts"] if m["mountPath"] == "/models"]
    (inp,) = [m for m in server["volumeMounts"] if m["mountPath"] == "/models"]
    assert out["name"] == inp["name"] and inp["readOnly"] is True and not out.get("readOnly")
    flags = [a for a in compose["triton"]["command"][1:] if "$" not in a]  # without the .env substitutions
    assert server["command"] == ["tritonserver"] and set(flags) <= set(server["args"])


def test_probes_see_a_dead_model_not_only_the_health_endpoint(gpu: list[dict]) -> None:
    triton = one(gpu, "Deployment", "triton")
    server = container(triton, "triton")
    # start-up: Triton ready AND the served model verified against its export's reference vectors
    verify = server["startupProbe"]["exec"]["command"]
    assert verify[0] == "sh" and server["startupProbe"]["timeoutSeconds"] >= 15  # docs/export.md: >= 15 s
    dockerfile = (REPO / "deploy" / "Dockerfile.server").read_text()
    (copied,) = [line for line in dockerfile.splitlines() if line.startswith("COPY") and "verify-ready.sh" in line]
    assert copied.split()[-1].rstrip("/") == str(Path(verify[1]).parent)  # the image carries the script there
    assert (REPO / "deploy" / Path(verify[1]).name).is_file()
    e = env(server)
    assert e["VERIFY_MODEL"] == TEXT.name and _mount_of(server, e["VERIFY_REPOSITORY"])["mountPath"] == "/models"
    for kind in ("readinessProbe", "livenessProbe"):
        assert server[kind]["exec"]["command"] == ["sh", "/canary/canary.sh"]
    (mount,) = [m for m in server["volumeMounts"] if m["mountPath"] == "/canary"]
    (volume,) = [v for v in triton["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    script = one(gpu, "ConfigMap", volume["configMap"]["name"])["data"]["canary.sh"]
    assert script == (K8S / "base" / "canary.sh").read_text()
    e = env(server)  # the canary's target is the committed text endpoint
    assert (e["CANARY_MODEL"], e["CANARY_INPUT"], int(e["CANARY_DIM"])) == (TEXT.name, TEXT.input[0].name,
                                                                            TEXT.output[0].dims[0])
    worst_s = int(e["CANARY_REPEAT"]) * int(e["CANARY_TIMEOUT_S"])
    ready, live = server["readinessProbe"], server["livenessProbe"]
    assert ready["timeoutSeconds"] > worst_s and live["timeoutSeconds"] > worst_s
    # out of rotation first, restarted later
    assert ready["periodSeconds"] * ready["failureThreshold"] < live["periodSeconds"] * live["failureThreshold"]
    gateway = container(one(gpu, "Deployment", "gateway"), "gateway")
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health"


def test_every_workload_has_limits_and_runs_unprivileged(gpu: list[dict], loadtest: list[dict]) -> None:
    workloads = [d for d in gpu + loadtest if d["kind"] in WORKLOADS]
    assert len(workloads) == 4
    for doc in workloads:
        pod = doc["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
        assert pod["automountServiceAccountToken"] is False
        for c in containers(doc):
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and "memory" in c["resources"]["limits"]
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert ":" in c["image"], f"{c['name']}: untagged image {c['image']}"


def _pods(docs: list[dict]) -> dict[str, dict]:
    """name -> (pod labels, named ports) of every workload."""
    out = {}
    for d in docs:
        if d["kind"] in WORKLOADS:
            ports = {p["name"]: p["containerPort"] for c in containers(d) for p in c.get("ports", [])}
            out[d["metadata"]["name"]] = {"labels": d["spec"]["template"]["metadata"]["labels"], "ports": ports}
    return out


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"matchExpressions not handled: {selector}"
    return selector.get("matchLabels", {}).items() <= labels.items()


def test_selectors_select_pods_and_their_named_ports(monitored: list[dict], loadtest: list[dict]) -> None:
    docs = monitored + loadtest
    pods = _pods(docs)
    for d in docs:
        kind, spec = d["kind"], d.get("spec", {})
        if kind == "Service":
            hit = [p for p in pods.values() if spec["selector"].items() <= p["labels"].items()]
            assert hit, f"Service {d['metadata']['name']} selects no pod"
            assert all(port["targetPort"] in hit[0]["ports"] for port in spec["ports"])
        elif kind in ("PodDisruptionBudget", "PodMonitor"):
            hit = [p for p in pods.values() if _selects(spec["selector"], p["labels"])]
            assert len(hit) == 1, f"{kind} {d['metadata']['name']} selects {len(hit)} workloads"
            assert all(ep["port"] in hit[0]["ports"] for ep in spec.get("podMetricsEndpoints", []))
        elif kind == "HorizontalPodAutoscaler":
            assert spec["scaleTargetRef"]["name"] in pods


def _allowed(policies: list[dict], src: tuple[str, dict], dst_labels: dict, dst_ports: dict, port: int) -> bool:
    """NetworkPolicy ingress semantics for a pod in bge-triton: allowed if no policy selects it, or one rule admits."""
    src_ns, src_labels = src
    chosen = [p for p in policies if _selects(p["spec"]["podSelector"], dst_labels)]
    for p in chosen:
        for rule in p["spec"].get("ingress", []):
            ports = [dst_ports.get(x["port"], x["port"]) for x in rule.get("ports", [])]
            peers = rule.get("from")
            ok_port = not ports or port in ports
            ok_peer = peers is None or any(
                ("namespaceSelector" in peer
                 and _selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": src_ns})
                 or "namespaceSelector" not in peer and src_ns == p["metadata"]["namespace"])
                and _selects(peer.get("podSelector", {}), src_labels) for peer in peers)
            if ok_port and ok_peer:
                return True
    return not chosen


@pytest.mark.parametrize("source,target,port,allowed", [
    (("elsewhere", {"app": "rag"}), "gateway", 8080, True),
    (("bge-triton", "gateway"), "triton", 8001, True),
    (("bge-triton", "gateway"), "triton", 8000, True),
    (("bge-triton", "gateway"), "triton", 8002, False),
    (("elsewhere", {"app": "rag"}), "triton", 8001, False),
    (("bge-triton", {"app": "other"}), "triton", 8000, False),
    (("monitoring", {"app.kubernetes.io/name": "prometheus"}), "triton", 8002, True),
    (("monitoring", {"app.kubernetes.io/name": "prometheus"}), "triton", 8001, False),
    (("monitoring", {"app": "grafana"}), "triton", 8002, False),
    (("bge-triton", "locust-worker"), "triton", 8000, True),
    (("bge-triton", "locust-worker"), "locust-master", 5557, True),
    (("bge-triton", {"app": "other"}), "locust-master", 5557, False),
])
def test_network_policies_expose_only_the_gateway(gpu: list[dict], loadtest: list[dict], source: tuple,
                                                  target: str, port: int, allowed: bool) -> None:
    docs = gpu + loadtest
    pods = _pods(docs)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert all(p["metadata"]["namespace"] == "bge-triton" for p in policies)
    ns, labels = source
    src = (ns, pods[labels]["labels"] if isinstance(labels, str) else labels)
    assert _allowed(policies, src, pods[target]["labels"], pods[target]["ports"], port) is allowed


def test_hpa_scales_on_the_adapter_rules_queue_signals(gpu: list[dict]) -> None:
    import promql_parser

    hpa = one(gpu, "HorizontalPodAutoscaler", "triton")["spec"]
    rules_cm = one(gpu, "ConfigMap", "bge-triton-adapter-rules")
    assert rules_cm["metadata"]["namespace"] == "monitoring"
    rules = {r["name"]["as"]: r for r in yaml.safe_load(rules_cm["data"]["config.yaml"])["rules"]}
    names = {m["pods"]["metric"]["name"] for m in hpa["metrics"]}
    assert names == {*capacity.RATIO_METRICS, capacity.QUEUE_METRIC}
    models = set()
    for metric in hpa["metrics"]:
        name, target = metric["pods"]["metric"]["name"], metric["pods"]["target"]
        assert metric["type"] == "Pods" and target["type"] == "AverageValue"
        query = rules[name]["metricsQuery"]
        tree = promql_parser.parse(query.replace("<<.LabelMatchers>>,", "").replace("<<.GroupBy>>", "pod"))
        assert isinstance(tree, promql_parser.BinaryExpr) and str(tree.op) == "/", query
        if name in capacity.RATIO_METRICS:  # NVIDIA's tutorial: queue over compute-infer time, target 1
            assert cm.promql_metric_names(str(tree.lhs)) == {"nv_inference_queue_duration_us"}
            assert cm.promql_metric_names(str(tree.rhs)) == {"nv_inference_compute_infer_duration_us"}
            assert target["averageValue"] == "1"
        else:  # (Triton's queue per successful request + the scheduler pool's wait per request) / 1000: ms
            assert str(tree.rhs) == "1000", query
            total = tree.lhs.expr if isinstance(tree.lhs, promql_parser.ParenExpr) else tree.lhs
            assert isinstance(total, promql_parser.BinaryExpr) and str(total.op) == "+", query
            triton, pool = total.lhs, total.rhs
            assert str(triton.op) == str(pool.op) == "/", query
            assert [cm.promql_metric_names(str(e)) for e in (triton.lhs, triton.rhs, pool.lhs, pool.rhs)] == [
                {"nv_inference_queue_duration_us"}, {"nv_inference_request_success"},
                {"kit_queue_duration_us_total"}, {"kit_queue_requests_total"}], query
            assert rules[name]["name"]["matches"] == "^kit_queue_duration_us_total$"
        models |= set(re.findall(r'model="([^"]+)"', query))
    assert models == {TEXT.name, ENCODER.name}


def test_queue_target_is_the_measured_one_at_the_stated_p99() -> None:
    """The HPA's queue target is what `capacity.py plan` derives from the committed measurement."""
    rows = capacity.read_capacity(REPO / "reports" / "scale" / "capacity.csv")
    _, _, targets = capacity.hpa_targets()
    want = capacity.recommended_queue_ms(rows, capacity.SLO_P99_MS)
    assert targets[capacity.QUEUE_METRIC] == round(want * 2) / 2  # to the half millisecond


BUILT = ("bge-triton-server", "bge-triton-gateway", "bge-triton-kit", "bge-triton-loadtest")


def test_images_are_the_built_ones_and_take_a_registry_through_kustomize_images(gpu: list[dict], loadtest: list[dict],
                                                                              tmp_path: Path) -> None:
    """The manifests name exactly what deploy/build-images.sh builds, at the kit's version; an overlay's `images:`
    (the block `build-images.sh --push REGISTRY` prints) moves every one of them to the registry."""
    version = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    script = (REPO / "deploy" / "build-images.sh").read_text()
    assert all(f"build {name} -f" in script for name in BUILT)
    images = {c["image"] for d in gpu + loadtest if d["kind"] in WORKLOADS for c in containers(d)}
    assert images == {f"{name}:{version}" for name in BUILT}
    overlay = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
               "resources": [os.path.relpath(K8S / tree, tmp_path) for tree in ("overlays/gpu", "loadtest")],
               "images": [{"name": n, "newName": f"registry.example/bge/{n}", "newTag": "test"} for n in BUILT]}
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    images = {c["image"] for d in cm.render(tmp_path) if d["kind"] in WORKLOADS for c in containers(d)}
    assert images == {f"registry.example/bge/{name}:test" for name in BUILT}


def test_gateway_and_locust_point_at_services_that_exist(gpu: list[dict], loadtest: list[dict]) -> None:
    args = container(one(gpu, "Deployment", "gateway"), "gateway")["args"]
    opts = dict(zip(args[::2], args[1::2], strict=True))
    host, port = opts["--triton"].split(":")
    triton_ports = {p["name"]: p["port"] for p in one(gpu, "Service", host)["spec"]["ports"]}
    assert int(port) == triton_ports["grpc"] and opts["--model"] == TEXT.name
    master = container(one(loadtest, "Job", "locust-master"), "locust")["args"]
    worker = container(one(loadtest, "Job", "locust-worker"), "locust")["args"]
    locustfile = "/kit/src/bge_triton/loadtest/locustfile.py"
    assert master[master.index("-f") + 1] == worker[worker.index("-f") + 1] == locustfile
    assert (REPO / "src" / "bge_triton" / "loadtest" / "locustfile.py").is_file()
    assert locustfile in (REPO / "deploy/Dockerfile.kit").read_text()  # the loadtest target puts it there
    flags = dict(a.split("=", 1) for a in master + worker if a.startswith("--") and "=" in a)
    assert flags["--host"] == f"http://{host}:{triton_ports['http']}"
    assert flags["--shape"] in shapes.SHAPES and flags["--triton-model"] == TEXT.name
    one(loadtest, "Service", flags["--master-host"])
    assert int(flags["--expect-workers"]) == one(loadtest, "Job", "locust-worker")["spec"]["parallelism"]


def test_cli_renders_and_validates_both_trees() -> None:
    proc = subprocess.run([sys.executable, str(K8S / "check_manifests.py")], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Deployment/triton: valid" in proc.stdout and "kit_queue_duration_us_total" in proc.stdout


def test_model_pvc_component_replaces_the_init_container_with_one_export_job(gpu: list[dict], tmp_path: Path) -> None:
    overlay = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
               "resources": [os.path.relpath(K8S / "overlays" / "gpu", tmp_path)],
               "components": [os.path.relpath(K8S / "components" / "model-pvc", tmp_path)]}
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    docs = cm.render(tmp_path)
    assert len(cm.validate(docs)) == len(docs)
    pvc = one(docs, "PersistentVolumeClaim", "bge-model-repository")
    assert pvc["metadata"]["namespace"] == "bge-triton" and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    triton = one(docs, "Deployment", "triton")
    spec = triton["spec"]["template"]["spec"]
    assert not spec.get("initContainers")
    volumes = {v["name"]: v for v in spec["volumes"]}
    (mount,) = [m for m in container(triton, "triton")["volumeMounts"] if m["mountPath"] == "/models"]
    assert volumes[mount["name"]] == {"name": mount["name"], "persistentVolumeClaim": {
        "claimName": "bge-model-repository", "readOnly": True}}
    job = one(docs, "Job", "export-model-repository")
    assert job["metadata"]["namespace"] == "bge-triton"
    export = container(job, "export")
    assert export["command"] == container(one(gpu, "Deployment", "triton"), "export", init=True)["command"]
    assert "nvidia.com/gpu" not in str(job)  # the export runs on the CPU
    job_volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    (out,) = [m for m in export["volumeMounts"] if m["mountPath"] == "/models"]
    assert job_volumes[out["name"]]["persistentVolumeClaim"]["claimName"] == "bge-model-repository"


def _mount_of(c: dict, path: str) -> dict | None:
    """The volumeMount that holds `path` (the longest mountPath above it), or None: the root filesystem."""
    above = [m for m in c.get("volumeMounts", []) if path == m["mountPath"] or path.startswith(m["mountPath"] + "/")]
    return max(above, key=lambda m: len(m["mountPath"]), default=None)


# flags and env of the kit's commands that name a path the command writes
WRITTEN_FLAGS = ("--repository", "--cache-dir", "--out", "--csv")
WRITTEN_ENV = ("HOME", "HF_HOME", "VERIFY_STATE_DIR")


def test_every_path_a_container_writes_is_a_writable_volume(gpu: list[dict], loadtest: list[dict],
                                                            tmp_path: Path) -> None:
    """readOnlyRootFilesystem: the exporter's --cache-dir (a relative .kit/cache under /kit raised OSError at
    mkdir), HOME, HF_HOME and every output flag must lie on a volume mounted read-write."""
    overlay = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
               "resources": [os.path.relpath(K8S / "overlays" / "gpu", tmp_path)],
               "components": [os.path.relpath(K8S / "components" / "model-pvc", tmp_path)]}
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    checked = 0
    for doc in gpu + loadtest + cm.render(tmp_path):
        if doc["kind"] not in WORKLOADS:
            continue
        for c in containers(doc):
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            argv = c.get("command", []) + c.get("args", [])
            paths = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in WRITTEN_FLAGS]
            paths += [a.split("=", 1)[1] for a in argv if a.split("=", 1)[0] in WRITTEN_FLAGS and "=" in a]
            paths += [v for k, v in env(c).items() if k in WRITTEN_ENV]
            for path in paths:
                mount = _mount_of(c, path)
                assert mount is not None and not mount.get("readOnly"), \
                    f"{doc['metadata']['name']}/{c['name']} writes {path} outside a writable volume"
                checked += 1
    export = container(one(gpu, "Deployment", "triton"), "export", init=True)
    assert "--cache-dir" in export["command"]  # its default, .kit/cache, is relative to the read-only /kit
    assert checked >= 12


def test_gateway_keeps_the_image_entrypoint_and_reads_its_key_from_the_secret(gpu: list[dict]) -> None:
    """The image's entrypoint turns $SECRETS_DIR/gateway_key into --api-keys-file: the container passes flags only,
    and its keys come from a Secret mounted there, under the file name the entrypoint reads."""
    gateway = one(gpu, "Deployment", "gateway")
    spec = gateway["spec"]["template"]["spec"]
    main = container(gateway, "gateway")
    assert "command" not in main, "a `command` replaces the image's entrypoint, which passes the key"
    dockerfile = (REPO / "deploy" / "Dockerfile.gateway").read_text()
    (entry,) = re.findall(r"^ENTRYPOINT\s*\[\s*\"([^\"]+)\"", dockerfile, re.M)
    script = (REPO / "deploy" / Path(entry).name).read_text()
    (keys_path,) = re.findall(r'keys="\$\{SECRETS_DIR:-[^}]*\}/(\w+)"', script)
    volumes = {v["name"]: v for v in spec["volumes"]}
    secret_dir = env(main)["SECRETS_DIR"]
    (mount,) = [m for m in main["volumeMounts"] if m["mountPath"] == secret_dir]
    secret = volumes[mount["name"]]["secret"]
    assert mount["readOnly"] is True and [i["path"] for i in secret["items"]] == [keys_path]
    assert secret.get("optional") is not True  # no Secret, no pod: the gateway never serves without a key
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"]
    assert secret["defaultMode"] & 0o040 and not secret["defaultMode"] & 0o007  # group-read only
    assert "GATEWAY_API_KEY" not in env(main)  # else the entrypoint would write the key into the read-only mount
    args = main["args"]
    assert not {"--api-key", "--api-keys-file", "--unsafe-no-auth"} & set(args)


def test_gateway_flags_build_the_gateways_settings(gpu: list[dict], tmp_path: Path) -> None:
    """The Deployment's args plus what the image's entrypoint adds (--api-keys-file) parse with the gateway's own
    parser into its settings: a flag it does not know, or a 0.0.0.0 bind without a key, would exit 2 at start."""
    from bge_triton.gateway.settings import build_parser, settings_from_args

    args = container(one(gpu, "Deployment", "gateway"), "gateway")["args"]
    keys = tmp_path / "gateway_key"
    keys.write_text("k" * 40 + "\n")
    settings = settings_from_args(build_parser().parse_args([*args, "--api-keys-file", str(keys)]))
    assert (settings.host, settings.port, settings.model) == ("0.0.0.0", 8080, TEXT.name)
    assert settings.api_keys == {"k" * 40}
