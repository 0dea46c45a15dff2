"""deploy/k8s/overlays/monitoring-operator: the Prometheus Operator's PodMonitor and PrometheusRule
scrape and alert exactly like the plain Prometheus config (same targets, same job label, same rules)."""

from __future__ import annotations

import yaml
from deploy_manifests import infermesh_deployments, of_kind
from deploy_tools import REPO, run

from tools import prometheus_rule

OVERLAY = REPO / "deploy" / "k8s" / "overlays" / "monitoring-operator"
PLAIN_CONFIG = REPO / "deploy" / "observability" / "prometheus" / "prometheus.yml"


def _render(kubectl) -> list[dict]:
    done = run([kubectl, "kustomize", str(OVERLAY)])
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def test_the_prometheus_rule_is_generated_from_the_current_rule_files():
    assert prometheus_rule.main([]) == 0, "run: python -m tools.prometheus_rule --write"


def test_the_prometheus_rule_groups_pass_promtool(promtool, tmp_path, kubectl):
    (rule,) = of_kind(_render(kubectl), "PrometheusRule")
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    done = run([promtool, "check", "rules", str(path)])
    assert done.returncode == 0, done.stdout + done.stderr
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert {"InfermeshGatewayDown", "InfermeshSchedulerDown", "InfermeshModelHasNoWorkers"} <= alerts


def test_the_overlay_adds_both_objects_to_the_observability_stack_in_one_namespace(kubectl):
    docs = _render(kubectl)
    assert len(of_kind(docs, "PodMonitor")) == 1 and len(of_kind(docs, "PrometheusRule")) == 1
    assert of_kind(docs, "Deployment"), "the collector from deploy/observability is included"
    assert {d["metadata"].get("namespace") for d in docs} == {"monitoring"}


def test_the_pod_monitor_scrapes_every_service_pod_as_the_plain_config_does(kubectl, rendered):
    (monitor,) = of_kind(_render(kubectl), "PodMonitor")
    spec = monitor["spec"]
    (endpoint,) = spec["podMetricsEndpoints"]
    plain = yaml.safe_load(PLAIN_CONFIG.read_text())["scrape_configs"][0]
    assert spec["namespaceSelector"]["matchNames"] == plain["kubernetes_sd_configs"][0]["namespaces"]["names"]
    for deployment in infermesh_deployments(rendered["cpu"]):
        pod = deployment["spec"]["template"]
        labels = pod["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items(), deployment["metadata"]["name"]
        ports = {p.get("name") for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        assert endpoint["port"] in ports, deployment["metadata"]["name"]
    # The job label the alerts and dashboard use: infermesh-<app.kubernetes.io/name>, as in the plain config.
    (job,) = [r for r in endpoint["relabelings"] if r["targetLabel"] == "job"]
    (plain_job,) = [r for r in plain["relabel_configs"] if r.get("target_label") == "job"]
    assert job["sourceLabels"] == plain_job["source_labels"] and job["replacement"] == plain_job["replacement"]
