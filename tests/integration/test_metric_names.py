"""Every Triton metric the prometheus-adapter rules, the alert rules and the Grafana dashboard query exists on a real
Triton's /metrics.

Scraped, not assumed: a real local tritonserver started with the deployment's metric flags (read from
deploy/k8s/base/triton.yaml: summary_latencies adds the *_summary_us families the dashboard's p99 uses),
after embeddings through the text endpoint. A name that Triton 2.51 does not emit would leave an HPA
with no metric (it holds its replica count) or a dashboard panel empty, and nothing else would say so.
"""
from __future__ import annotations

import importlib.util
import re
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from bge_triton.client import EmbeddingClient
from bge_triton.repository import get_param, load_repository

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
_spec = importlib.util.spec_from_file_location("check_manifests", K8S / "check_manifests.py")
cm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cm)

# Triton exports nv_gpu_* only where it finds an NVIDIA GPU through DCGM (and --allow-gpu-metrics=true,
# which the local launcher sets false): a CPU server cannot show them, so they are listed here, not checked.
GPU_ONLY = {
    "nv_gpu_utilization": "GPU utilisation panel",
    "nv_gpu_memory_used_bytes": "GPU memory panel",
    "nv_gpu_memory_total_bytes": "GPU memory panel",
}
TARGET_LABELS = {"namespace", "pod"}  # added by Prometheus from the pod it scrapes, not by Triton


def deployment_metric_flags() -> tuple[str, ...]:
    """The Triton container's --metrics-config flags in the Kubernetes base (the compose file has the same)."""
    docs = list(yaml.safe_load_all((K8S / "base" / "triton.yaml").read_text()))
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (server,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "triton"]
    return tuple(a for a in server["args"] if a.startswith("--metrics-config"))


@pytest.fixture(scope="module")
def scraped(minilm_repo: Path, server_factory) -> tuple[dict[str, list], dict]:
    """Sample name -> samples from /metrics of a server with the deployment's metric flags, after 8 embeddings."""
    from prometheus_client.parser import text_string_to_metric_families

    flags = deployment_metric_flags()
    assert flags, "deploy/k8s/base/triton.yaml lost its --metrics-config flags"
    srv = server_factory(minilm_repo, extra_args=flags)
    configs = load_repository(minilm_repo)
    text = next(name for name, c in configs.items() if get_param(c, "onnx_model"))
    with EmbeddingClient(srv.grpc_url, model=text) as client:
        client.embed_documents([f"度量 {i}: metric names test" for i in range(8)])
    # the text endpoint sends its own counters every metrics_flush_s from a thread: wait for them to arrive
    # (bounded generously, not tuned to a quiet machine; a scrape is cheap)
    deadline = time.monotonic() + 120
    while True:
        body = urllib.request.urlopen(srv.metrics_url, timeout=10).read().decode()
        if re.search(r"^kit_queue_requests_total\{[^}]*\} [1-9]", body, re.M) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    # the parser names a counter family without _total and its samples with it; Prometheus stores the names
    # as exposed (Triton's nv_* counters without _total, the kit's with it): the # TYPE lines have them
    exposed = {name.removesuffix("_total"): name for name in re.findall(r"^# TYPE (\S+) counter$", body, re.M)}
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(body):
        samples.setdefault(family.name, [])
        for s in family.samples:
            name = exposed.get(family.name, family.name) if family.type == "counter" else s.name
            samples.setdefault(name, []).append(s)
            if name != family.name:  # a summary's _count/_sum also count as the family's
                samples[family.name].append(s)
    return samples, {"text": text, "encoder": get_param(configs[text], "onnx_model")}


def queried() -> dict[str, set[str]]:
    """Triton's names the adapter rules, the alert rules and the dashboard query (the gateway's own names are
    checked against its exposition in tests/unit/test_compose_monitoring.py; `up` is Prometheus')."""
    names = cm._merge([cm.adapter_selectors(), cm.alert_selectors(), cm.dashboard_selectors()])
    return {n: labels for n, labels in names.items() if not n.startswith("gateway_") and n != "up"}


def test_the_rules_and_dashboard_query_the_hpa_signal_at_all() -> None:
    names = queried()
    assert {"nv_inference_queue_duration_us", "nv_inference_compute_infer_duration_us",
            "kit_queue_duration_us_total", "kit_queue_requests_total"} <= set(names)
    assert {n for n in names if n.startswith("nv_gpu_")} <= set(GPU_ONLY), "list new GPU-only names in GPU_ONLY"


def test_every_queried_metric_is_on_the_real_metrics_endpoint(scraped) -> None:
    samples, _ = scraped
    missing = {n for n in set(queried()) - set(GPU_ONLY) if not samples.get(n)}
    assert not missing, f"queried but not exported by Triton 2.51: {sorted(missing)}"
    assert not set(GPU_ONLY) & set(samples), "a CPU server exported GPU metrics: GPU_ONLY is wrong"


def test_every_label_the_queries_match_on_is_on_the_samples(scraped) -> None:
    samples, _ = scraped
    for name, labels in queried().items():
        if name in GPU_ONLY:
            continue
        have = set().union(*(s.labels for s in samples[name]))
        assert labels - TARGET_LABELS <= have, f"{name}: queries match {sorted(labels)}, samples carry {sorted(have)}"


def test_hpa_series_exist_for_both_models_and_count_the_inference(scraped) -> None:
    samples, models = scraped
    for name in ("nv_inference_queue_duration_us", "nv_inference_compute_infer_duration_us"):
        per_model = {s.labels["model"] for s in samples[name]}
        assert {models["text"], models["encoder"]} <= per_model, (name, per_model)
    (count,) = [s.value for s in samples["nv_inference_count"] if s.labels["model"] == models["text"]]
    assert count >= 8
    compute = [s.value for s in samples["nv_inference_compute_infer_duration_us"]
               if s.labels["model"] == models["text"]]
    assert compute[0] > 0
    # the text endpoint's pool wait (triton_text_queue_ms), its own counters, labelled with the model's name
    (requests,) = [s.value for s in samples["kit_queue_requests_total"] if s.labels["model"] == models["text"]]
    assert requests >= 1
    assert [s.labels["model"] for s in samples["kit_queue_duration_us_total"]] == [models["text"]]
