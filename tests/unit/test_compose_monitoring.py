"""The monitoring profile's files: Prometheus scrapes Triton, Grafana gets a datasource and dashboard."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_prometheus_scrapes_triton_metrics_port() -> None:
    cfg = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = [t for job in cfg["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert "triton:8002" in targets


def test_grafana_provisioning() -> None:
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    dash = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/bge-triton.yml").read_text())
    assert dash["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_dashboard_has_the_four_signals() -> None:
    dash = json.loads((DEPLOY / "grafana/dashboards/bge-triton.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    uids = {t["datasource"]["uid"] for p in dash["panels"] for t in p["targets"]}
    assert uids == {"prometheus"}
    assert 'nv_inference_request_summary_us{model=~"$model",quantile="0.99"}' in exprs  # p99
    assert "nv_inference_queue_duration_us" in exprs  # queue time
    # the pool wait
    assert ("rate(kit_queue_duration_us_total{model=~\"$model\"}[$__rate_interval]) / "
            "rate(kit_queue_requests_total") in exprs
    assert ("rate(nv_inference_count{model=~\"$model\"}[$__rate_interval]) / "
            "rate(nv_inference_exec_count{model=~\"$model\"}[$__rate_interval])") in exprs  # avg batch
    assert "nv_gpu_utilization" in exprs
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
