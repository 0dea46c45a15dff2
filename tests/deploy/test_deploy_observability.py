"""Prometheus config and rules (promtool), prometheus-adapter's rule, the Grafana dashboard and
the OpenTelemetry Collector config, all held to the metric contract in metrics.yaml."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from deploy_manifests import by_name, infermesh_deployments, of_kind, service_of
from deploy_promql import metric_names, promtool_check_exprs, series_of, unknown_labels, unknown_names
from deploy_tools import REPO, run

OBSERVABILITY = REPO / "deploy" / "observability"
PROMETHEUS = OBSERVABILITY / "prometheus"
RULE_FILES = sorted((PROMETHEUS / "rules").glob("*.yml"))
ALERT_TESTS = REPO / "tests" / "deploy" / "promtool" / "infermesh-alerts.test.yml"
DASHBOARD = OBSERVABILITY / "grafana" / "dashboards" / "infermesh.json"
OPERATIONS = REPO / "docs" / "operations.md"
# The alerts the issue asks for, by what they watch.
REQUIRED_ALERTS = {
    "p99 over SLO": "InfermeshClassifyLatencyP99OverSLO",
    "generate SLO": "InfermeshTimeToFirstTokenP99OverSLO",
    "queue time rising": "InfermeshQueueTimeRising",
    "KV usage > 95%": "InfermeshKVCacheNearlyFull",
    "preemption rate": "InfermeshPreemptionRateHigh",
    "error rate": "InfermeshErrorRateHigh",
    "retry budget exhausted": "InfermeshRetryBudgetExhausted",
    "worker not ready": "InfermeshWorkerNotReady",
    "no gateway up": "InfermeshGatewayDown",
    "no scheduler up": "InfermeshSchedulerDown",
    "one gateway or scheduler replica down": "InfermeshReplicaDown",
    "model without workers, series present or not": "InfermeshModelHasNoWorkers",
}
RUNBOOK_BASE = "https://github.com/infermesh/infermesh/blob/main/docs/operations.md#"
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$namespace": ".*", "$model": ".*"}


def rules() -> list[dict]:
    return [rule for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


def recorded_names() -> set[str]:
    return {rule["record"] for rule in rules() if "record" in rule}


# --------------------------------------------------------------------------- Prometheus


def test_compose_prometheus_config_passes_promtool(promtool):
    done = run([promtool, "check", "config", str(PROMETHEUS / "prometheus-compose.yml")])
    assert done.returncode == 0, done.stdout + done.stderr


def test_kubernetes_prometheus_config_passes_promtool_and_discovers_the_infermesh_namespace(promtool, rendered, tmp_path):
    # Debian's promtool is built without Kubernetes service discovery, so promtool checks a copy
    # whose kubernetes_sd_configs block is replaced by a static target (everything else intact:
    # globals, rule files, alerting, relabelling); the SD block itself is checked here.
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    (sd,) = job.pop("kubernetes_sd_configs")
    job["static_configs"] = [{"targets": ["127.0.0.1:9101"]}]
    (tmp_path / "rules").symlink_to(PROMETHEUS / "rules")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    done = run([promtool, "check", "config", str(tmp_path / "prometheus.yml")])
    assert done.returncode == 0, done.stdout + done.stderr

    namespaces = {d["metadata"]["namespace"] for d in infermesh_deployments(rendered["cpu"])}
    assert sd["role"] == "pod" and set(sd["namespaces"]["names"]) == namespaces
    targets = {r.get("target_label") for r in job["relabel_configs"]}
    assert {"job", "namespace", "pod"} <= targets, "alerts, dashboard and adapter group by these"
    keep = {r["source_labels"][0]: r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"}
    for deployment in infermesh_deployments(rendered["cpu"]):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert re.fullmatch(keep["__meta_kubernetes_pod_label_app_kubernetes_io_part_of"], labels["app.kubernetes.io/part-of"])
        port_names = [p["name"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]]
        assert sum(bool(re.fullmatch(keep["__meta_kubernetes_pod_container_port_name"], n)) for n in port_names) == 1


def test_job_names_are_the_ones_the_alerts_use(rendered):
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    (job_rule,) = [r for r in config["scrape_configs"][0]["relabel_configs"] if r.get("target_label") == "job"]
    k8s_jobs = {job_rule["replacement"].replace("$1", service_of(d)) for d in infermesh_deployments(rendered["cpu"])}
    compose_jobs = {j["job_name"] for j in yaml.safe_load((PROMETHEUS / "prometheus-compose.yml").read_text())["scrape_configs"]}
    assert k8s_jobs == compose_jobs == {"infermesh-gateway", "infermesh-scheduler", "infermesh-worker"}
    used = {m for rule in rules() for m in re.findall(r'job="([^"]+)"', rule["expr"])}
    assert used <= k8s_jobs


def test_rules_pass_promtool(promtool):
    done = run([promtool, "check", "rules", *map(str, RULE_FILES)])
    assert done.returncode == 0, done.stdout + done.stderr


def test_alerts_fire_on_the_series_that_should_trigger_them(promtool):
    # tests/deploy/promtool: each alert fires for the bad series and not for a healthy neighbour.
    done = run([promtool, "test", "rules", str(ALERT_TESTS)])
    assert done.returncode == 0, done.stdout + done.stderr
    tested = set(re.findall(r"alertname: (\w+)", ALERT_TESTS.read_text()))
    assert tested == {rule["alert"] for rule in rules() if "alert" in rule}, "every alert has a promtool test"


def test_every_required_alert_exists_with_severity_and_runbook():
    alerts = {rule["alert"]: rule for rule in rules() if "alert" in rule}
    assert set(REQUIRED_ALERTS.values()) <= alerts.keys()
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("page", "ticket"), name
        # Alertmanager and Grafana link `runbook_url` (a URL), not a repository path.
        assert "runbook" not in rule["annotations"], name
        assert rule["annotations"]["runbook_url"] == f"{RUNBOOK_BASE}{name.lower()}"


def test_rules_use_only_contract_metrics_and_their_labels(contract):
    recorded = recorded_names()
    for rule in rules():
        where = rule.get("record") or rule["alert"]
        assert not unknown_names(rule["expr"], contract, recorded), where
        if "record" in rule:
            assert not unknown_labels(rule["expr"], contract), where


def test_contract_checks_catch_unknown_metrics_and_labels(contract):
    # The checks above are only as good as these helpers; show they bite.
    assert unknown_names("rate(infermesh_scheduler_preemption_total[5m])", contract) == {"infermesh_scheduler_preemption_total"}
    assert not unknown_names('up{job="infermesh-worker"}', contract), "names inside strings are values, not metrics"
    bad_grouping = "sum by (tenant) (rate(infermesh_scheduler_preemptions_total[5m]))"
    assert unknown_labels(bad_grouping, contract) == {"tenant"}
    bucket = 'histogram_quantile(0.9, sum by (le, model) (rate(infermesh_scheduler_queue_time_seconds_bucket{priority="critical"}[5m])))'
    assert not unknown_labels(bucket, contract)


# --------------------------------------------------------------------------- prometheus-adapter


def adapter_rule() -> dict:
    (rule,) = yaml.safe_load((OBSERVABILITY / "prometheus-adapter" / "config.yaml").read_text())["externalRules"]
    return rule


def test_adapter_serves_the_metric_the_worker_hpas_scale_on(rendered, contract):
    rule = adapter_rule()
    series = metric_names(rule["seriesQuery"])
    assert series == {"infermesh_scheduler_queue_time_seconds_bucket"} and series <= series_of(contract).keys()
    assert re.fullmatch(rule["name"]["matches"], next(iter(series)))
    for overlay in ("cpu", "gpu"):
        for hpa in of_kind(rendered[overlay], "HorizontalPodAutoscaler"):
            for metric in hpa["spec"]["metrics"]:
                if metric["type"] == "External":
                    assert metric["external"]["metric"]["name"] == rule["name"]["as"]
                    selector = metric["external"]["metric"]["selector"]["matchLabels"]
                    assert selector.keys() <= set(contract["infermesh_scheduler_queue_time_seconds"]["labels"])
    assert rule["resources"]["overrides"]["namespace"]["resource"] == "namespace"


def test_adapter_query_is_valid_promql_once_templated(promtool, tmp_path, contract):
    rule = adapter_rule()
    query = (rule["metricsQuery"]
             .replace("<<.Series>>", "infermesh_scheduler_queue_time_seconds_bucket")
             .replace("<<.LabelMatchers>>", 'namespace="infermesh",model="digits"')
             .replace("<<.GroupBy>>", "namespace"))
    ok, output = promtool_check_exprs(promtool, {"adapter metricsQuery": query}, tmp_path)
    assert ok, output
    assert not unknown_labels(query, contract)


# --------------------------------------------------------------------------- Grafana


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panel_exprs(dashboard: dict) -> dict[str, str]:
    out = {}
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            out[f"{panel['title']} / {target['refId']}"] = expr
    return out


def test_dashboard_reads_top_down_request_slo_then_queue_batch_then_workers_kv(dashboard):
    rows = sorted((p for p in dashboard["panels"] if p["type"] == "row"), key=lambda p: p["gridPos"]["y"])
    titles = [row["title"].lower() for row in rows]
    assert len(titles) == 4
    assert "slo" in titles[0] and "queue" in titles[1] and "batch" in titles[1] and "kv" in titles[2]
    assert "gpu" in titles[3], "the GPU overlay's panels last: empty on CPU workers"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    # Panels belong to the row above them, in reading order.
    rows_of: dict[str, list[dict]] = {}
    current = None
    for panel in sorted(dashboard["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"])):
        if panel["type"] == "row":
            current = panel["title"]
        else:
            assert current is not None, f"{panel['title']} sits above the first row"
            assert panel.get("targets"), panel["title"]
            rows_of.setdefault(current, []).append(panel)
    assert all(rows_of.get(row["title"]) for row in rows), "every row holds panels"
    boxes = [(p["title"], p["gridPos"]) for p in dashboard["panels"]]
    for title, box in boxes:
        assert 0 <= box["x"] and box["x"] + box["w"] <= 24, title
    for i, (title, a) in enumerate(boxes):
        for other, b in boxes[i + 1:]:
            overlap = (a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"]
                       and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"])
            assert not overlap, f"{title!r} overlaps {other!r}"


def test_dashboard_queries_are_valid_promql(promtool, dashboard, tmp_path):
    ok, output = promtool_check_exprs(promtool, panel_exprs(dashboard), tmp_path)
    assert ok, output


def test_dashboard_uses_only_contract_metrics_and_labels(dashboard, contract):
    exprs = panel_exprs(dashboard)
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            exprs[f"variable {variable['name']}"] = variable["definition"]
    used = set()
    for where, expr in exprs.items():
        assert not unknown_names(expr, contract), f"{where}: {unknown_names(expr, contract)}"
        assert not unknown_labels(expr, contract), f"{where}: {unknown_labels(expr, contract)}"
        used |= metric_names(expr)
    # The dashboard shows every contract metric somewhere.
    shown = {name for name in contract if any(s.startswith(name) for s in used)}
    assert shown == set(contract), f"not on the dashboard: {set(contract) - shown}"


def test_grafana_provisioning_points_at_the_dashboard_and_prometheus():
    compose = yaml.safe_load((REPO / "deploy" / "compose.yaml").read_text())
    provider = yaml.safe_load((OBSERVABILITY / "grafana/provisioning/dashboards/infermesh.yaml").read_text())
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1)[::-1] for v in compose["services"]["grafana"]["volumes"])
    assert mounts[provider["providers"][0]["options"]["path"]] == "./observability/grafana/dashboards"
    datasource = yaml.safe_load((OBSERVABILITY / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert datasource["datasources"][0]["url"].endswith(":9090") and "prometheus" in compose["services"]


# --------------------------------------------------------------------------- OpenTelemetry Collector


@pytest.fixture(scope="module")
def collector() -> dict:
    return yaml.safe_load((OBSERVABILITY / "otel-collector" / "config.yaml").read_text())


def test_collector_pipelines_reference_only_defined_components(collector):
    service = collector["service"]
    assert set(service["extensions"]) <= collector["extensions"].keys()
    for name, pipeline in service["pipelines"].items():
        for kind in ("receivers", "processors", "exporters"):
            missing = set(pipeline.get(kind, [])) - collector.get(kind, {}).keys()
            assert not missing, f"pipeline {name}: undefined {kind} {missing}"
    traces = service["pipelines"]["traces"]
    assert traces["receivers"] == ["otlp"]
    assert traces["processors"][0] == "memory_limiter" and "batch" in traces["processors"]


def test_production_pipelines_export_nothing_to_the_collector_log(collector):
    # The debug exporter logs every span: never in the shipped pipeline.
    for name, pipeline in collector["service"]["pipelines"].items():
        assert not [e for e in pipeline["exporters"] if e.split("/")[0] in ("debug", "logging")], name


def test_retries_panel_separates_retries_from_other_verdicts(dashboard):
    (panel,) = [p for p in dashboard["panels"] if p.get("title") == "Retries"]
    exprs = [t["expr"] for t in panel["targets"]]
    assert any('verdict="retry"' in e for e in exprs), "the retries actually made"
    assert all("verdict" in e for e in exprs), "a series summing every verdict mixes refusals with retries"


def test_collector_receives_otlp_on_all_interfaces_where_services_send_it(collector, rendered):
    protocols = collector["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"] == "0.0.0.0:4317" and protocols["http"]["endpoint"] == "0.0.0.0:4318"
    deployment = by_name(rendered["observability"], "Deployment", "otel-collector")
    ports = {p["name"]: p["containerPort"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports["otlp-grpc"] == int(protocols["grpc"]["endpoint"].rsplit(":", 1)[1])
    # The config the Deployment mounts is this file.
    config_map = by_name(rendered["observability"], "ConfigMap",
                         deployment["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"])
    assert yaml.safe_load(config_map["data"]["config.yaml"]) == collector


def test_collector_backend_endpoint_is_set_wherever_the_config_runs(collector, rendered):
    variables = set(re.findall(r"\$\{env:(\w+)\}", (OBSERVABILITY / "otel-collector" / "config.yaml").read_text()))
    assert variables == {"TRACES_BACKEND_ENDPOINT"}
    deployment = by_name(rendered["observability"], "Deployment", "otel-collector")
    k8s_env = {e["name"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    compose = yaml.safe_load((REPO / "deploy" / "compose.yaml").read_text())
    assert variables <= k8s_env and variables <= compose["services"]["otel-collector"]["environment"].keys()
    for overlay_service in compose["services"].values():
        endpoint = overlay_service.get("environment", {}).get("OTEL_EXPORTER_OTLP_ENDPOINT")
        assert endpoint in (None, "http://otel-collector:4317")
