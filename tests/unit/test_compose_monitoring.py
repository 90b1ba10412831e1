"""Monitoring: Prometheus scrapes Triton and the gateway and loads the alert rules (checked and unit-tested by
promtool, Prometheus' own rule parser and evaluator), Kubernetes ships the same rules, Grafana gets a datasource
and a dashboard with Triton and gateway panels, and every gateway metric the rules and the dashboard name is one the
gateway exports. The Triton metric names are checked against a real server in tests/integration/test_metric_names.py.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from tests.deploy.ci import must_run

from bge_triton.gateway.metrics import GatewayMetrics

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
PROMETHEUS = DEPLOY / "prometheus"
_spec = importlib.util.spec_from_file_location("check_manifests", DEPLOY / "k8s" / "check_manifests.py")
cm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cm)
PROMTOOL = shutil.which("promtool")
must_run(None if PROMTOOL else "no promtool", "the alert rule tests")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool absent: apt-get install -y prometheus (Debian; .ci/run installs it)")
ALERTS = {r["alert"] for g in yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"] for r in g["rules"]}
# the series Prometheus makes itself, not an exporter
SYNTHETIC = {"up"}


def test_prometheus_scrapes_triton_and_the_gateway_and_loads_the_rules() -> None:
    cfg = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    jobs = {job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
            for job in cfg["scrape_configs"]}
    assert jobs == {"triton": ["triton:8002"], "gateway": ["gateway:8080"]}
    assert cfg["rule_files"] == ["alerts.yml"]
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["prometheus"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in compose["volumes"]  # config and rules side by side
    assert "--config.file=/etc/prometheus/prometheus.yml" in compose["command"]


@needs_promtool
def test_promtool_accepts_the_config_and_the_rules(tmp_path: Path) -> None:
    for args in (["check", "config", str(PROMETHEUS / "prometheus.yml")],
                 ["check", "rules", str(PROMETHEUS / "alerts.yml")]):
        proc = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in proc.stdout
    # the Kubernetes rules, as promtool reads a rules file
    rule = yaml.safe_load((DEPLOY / "k8s/components/monitoring/prometheusrule.yaml").read_text())
    (tmp_path / "k8s.yml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    proc = subprocess.run([PROMTOOL, "check", "rules", str(tmp_path / "k8s.yml")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_kubernetes_ships_the_same_rules() -> None:
    """components/monitoring's PrometheusRule is alerts.yml's groups (make_rule.py writes it)."""
    rule = yaml.safe_load((DEPLOY / "k8s/components/monitoring/prometheusrule.yaml").read_text())
    assert rule["kind"] == "PrometheusRule" and rule["metadata"]["labels"]["release"] == "prometheus"
    assert rule["spec"]["groups"] == yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"], \
        "rerun python deploy/k8s/components/monitoring/make_rule.py"
    cm.check_rule(rule)


# promtool test rules: each alert fires on the series that mean trouble and stays quiet on a healthy stack
# (series as Prometheus stores them: Triton's counters without _total, the kit's and the gateway's with it)
HEALTHY = [
    {"series": 'up{job="triton",instance="triton:8002"}', "values": "1x20"},
    {"series": 'up{job="bge-triton/gateway",instance="10.0.0.7:8080"}', "values": "1x20"},
    {"series": 'gateway_ready{instance="g"}', "values": "1x20"},
    {"series": 'nv_inference_request_success{model="bge_large_zh",version="1",instance="t"}', "values": "0+600x20"},
    {"series": 'nv_inference_request_failure{model="bge_large_zh",version="1",instance="t"}', "values": "0x20"},
    {"series": 'nv_inference_request_summary_us{model="bge_large_zh",version="1",quantile="0.99",instance="t"}',
     "values": "20000x20"},
    {"series": 'nv_inference_queue_duration_us{model="bge_large_zh",version="1",instance="t"}',
     "values": "0+600000x20"},  # 1 ms per request
    {"series": 'kit_queue_duration_us_total{model="bge_large_zh",instance="t"}', "values": "0+600000x20"},
    {"series": 'kit_queue_requests_total{model="bge_large_zh",instance="t"}', "values": "0+600x20"},
    {"series": 'gateway_requests_total{route="/v1/embeddings",status="200",instance="g"}', "values": "0+600x20"},
]
# alert -> (series replacing the healthy ones of the same name and labels, the labels it keeps, its summary as the
# series make it: 600 successes a minute against 600 failures, 60 503s, 120 429s; 250 ms; 1 + 80 ms of queues)
TROUBLE: dict[str, tuple[list[dict], dict[str, str], str]] = {
    "BgeTritonDown": ([{"series": 'up{job="triton",instance="triton:8002"}', "values": "0x20"}],
                      {"job": "triton", "instance": "triton:8002"},
                      "Triton's metrics endpoint on triton:8002 does not answer"),
    "BgeGatewayDown": ([{"series": 'up{job="bge-triton/gateway",instance="10.0.0.7:8080"}', "values": "0x20"}],
                       {"job": "bge-triton/gateway", "instance": "10.0.0.7:8080"},
                       "The gateway on 10.0.0.7:8080 does not answer /metrics"),
    "BgeNotReady": ([{"series": 'gateway_ready{instance="g"}', "values": "0x20"}], {"instance": "g"},
                    "The canary embedding through Triton fails on g"),
    "BgeTritonErrorRate": ([  # a dead stub: every request fails
        {"series": 'nv_inference_request_failure{model="bge_large_zh",version="1",instance="t"}',
         "values": "0+600x20"}], {"model": "bge_large_zh"}, "bge_large_zh: 50% of requests fail"),
    "BgeP99LatencyHigh": ([
        {"series": 'nv_inference_request_summary_us{model="bge_large_zh",version="1",quantile="0.99",instance="t"}',
         "values": "250000x20"}], {"model": "bge_large_zh"}, "P99 of bge_large_zh is 250 ms (objective 100 ms)"),
    "BgeQueueTimeHigh": ([  # 80 ms per request in the scheduler's pool
        {"series": 'kit_queue_duration_us_total{model="bge_large_zh",instance="t"}', "values": "0+48000000x20"}],
        {"instance": "t"}, "Requests wait 81 ms in the queues of t"),
    "BgeGateway5xx": ([
        {"series": 'gateway_requests_total{route="/v1/embeddings",status="503",instance="g"}', "values": "0+60x20"}],
        {"instance": "g"}, "9.091% of the gateway's answers on g are 5xx"),
    "BgeGateway429": ([
        {"series": 'gateway_requests_total{route="/v1/embeddings",status="429",instance="g"}', "values": "0+120x20"}],
        {"instance": "g"}, "16.67% of the gateway's answers on g are 429"),
}


def _series(alert: str | None) -> list[dict]:
    trouble = TROUBLE[alert][0] if alert else []
    names = {t["series"] for t in trouble}
    return [s for s in HEALTHY if s["series"] not in names] + trouble


@needs_promtool
def test_each_alert_fires_on_its_trouble_and_none_on_a_healthy_stack(tmp_path: Path) -> None:
    assert set(TROUBLE) == ALERTS, "give every alert its trouble here"
    shutil.copy(PROMETHEUS / "alerts.yml", tmp_path / "alerts.yml")
    tests = [{"interval": "1m", "input_series": _series(None),
              "alert_rule_test": [{"eval_time": "15m", "alertname": a, "exp_alerts": []} for a in sorted(ALERTS)]}]
    for alert in sorted(ALERTS):
        _, labels, summary = TROUBLE[alert]
        rule = _rule(alert)
        fired = [{"exp_labels": {"severity": rule["labels"]["severity"], **labels},
                  "exp_annotations": {"summary": summary, "description": rule["annotations"]["description"]}}]
        checks = [{"eval_time": "15m", "alertname": a, "exp_alerts": fired if a == alert else []}
                  for a in sorted(ALERTS)]
        tests.append({"interval": "1m", "input_series": _series(alert), "alert_rule_test": checks})
    (tmp_path / "test.yml").write_text(yaml.safe_dump({"rule_files": ["alerts.yml"], "evaluation_interval": "1m",
                                                       "tests": tests}))
    proc = subprocess.run([PROMTOOL, "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _rule(alert: str) -> dict:
    groups = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
    return next(r for g in groups for r in g["rules"] if r["alert"] == alert)


def _gateway_exposition() -> set[str]:
    """Sample names the gateway's /metrics carries once every labelled family has a child."""
    metrics = GatewayMetrics(verified=True)
    metrics.observe("/v1/embeddings", 200, 0.01)
    metrics.embedded(0, 0.01, 1, 8)
    metrics.stages({"tokenization": 0.001, "queue": 0.002, "inference": 0.003})
    metrics.loop_lag.observe(0.001)
    text = metrics.render().decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_every_gateway_metric_the_rules_and_dashboard_name_is_exported() -> None:
    exported = _gateway_exposition()
    named = set(cm.alert_selectors()) | set(cm.dashboard_selectors())
    gateway = {n for n in named if n.startswith("gateway_")}
    assert {"gateway_requests_total", "gateway_ready", "gateway_stage_duration_seconds_bucket",
            "gateway_triton_duration_seconds_bucket"} <= gateway
    assert gateway <= exported, f"not exported by the gateway: {sorted(gateway - exported)}"
    others = named - gateway - SYNTHETIC
    assert all(n.startswith(("nv_", "kit_")) for n in others), sorted(others)  # Triton's: the integration test


def test_grafana_provisioning() -> None:
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    dash = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/bge-triton.yml").read_text())
    assert dash["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def _exprs(dash: dict) -> str:
    return " ".join(t["expr"] for p in dash["panels"] for t in p.get("targets", []))


def test_dashboard_has_the_four_signals() -> None:
    dash = json.loads((DEPLOY / "grafana/dashboards/bge-triton.json").read_text())
    exprs = _exprs(dash)
    uids = {t["datasource"]["uid"] for p in dash["panels"] for t in p.get("targets", [])}
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


def test_dashboard_has_the_gateway_panels() -> None:
    """Requests, errors by status, the timing headers' split, priority levels: each a panel on the gateway's names."""
    dash = json.loads((DEPLOY / "grafana/dashboards/bge-triton.json").read_text())
    by_title = {p["title"]: " ".join(t["expr"] for t in p.get("targets", [])) for p in dash["panels"]}
    wanted = {"requests by route": "sum by (route) (rate(gateway_requests_total",
              "errors by status": 'sum by (status) (rate(gateway_requests_total{status!~"2.."}',
              "x-*-time headers": "sum by (stage) (rate(gateway_stage_duration_seconds_sum",
              "by priority level": "sum by (priority) (rate(gateway_triton_duration_seconds_count"}
    for title, expr in wanted.items():
        assert any(title in t and expr in e for t, e in by_title.items()), (title, expr)
    cells = [p["gridPos"] for p in dash["panels"]]  # no two panels on the same cell
    assert len({(c["x"], c["y"]) for c in cells}) == len(cells)
