"""/metrics over HTTPS wherever it leaves the pod (issue 13): compose and Kubernetes turn metrics TLS
on, and every scrape config speaks HTTPS, trusts the mesh CA and checks a name every service
certificate carries (targets are pod IPs or per-replica container names)."""

from __future__ import annotations

import shlex
import subprocess
import sys

import yaml
from cryptography import x509
from deploy_manifests import of_kind
from deploy_tools import REPO

SCRAPE_NAME = "infermesh-metrics"
COMPOSE = REPO / "deploy" / "compose.yaml"
PROMETHEUS = REPO / "deploy" / "observability" / "prometheus"
ENV_FILES = sorted((REPO / "deploy" / "k8s" / "base").glob("*/*.env"))


def test_nothing_turns_metrics_tls_off_in_compose_or_kubernetes():
    compose = COMPOSE.read_text()
    assert "_METRICS_TLS" not in compose
    for path in ENV_FILES:
        settings = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
        assert not [s for s in settings if "_METRICS_TLS=" in s], path


def test_every_scrape_config_is_https_with_the_mesh_ca_and_the_shared_name():
    compose = yaml.safe_load((PROMETHEUS / "prometheus-compose.yml").read_text())
    kubernetes = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    for job in compose["scrape_configs"] + kubernetes["scrape_configs"]:
        assert job["scheme"] == "https", job["job_name"]
        assert job["tls_config"]["server_name"] == SCRAPE_NAME, job["job_name"]
        assert job["tls_config"]["ca_file"].endswith(("ca.pem", "ca.crt")), job["job_name"]
    # compose's Prometheus reads the CA from the volume tls-init writes.
    prometheus = yaml.safe_load(COMPOSE.read_text())["services"]["prometheus"]
    assert "tls:/etc/infermesh/tls:ro" in prometheus["volumes"]
    assert prometheus["depends_on"]["tls-init"]["condition"] == "service_completed_successfully"
    assert compose["scrape_configs"][0]["tls_config"]["ca_file"].startswith("/etc/infermesh/tls/")


def test_the_pod_monitor_scrapes_https_with_the_ca_bundle(kubectl):
    docs = yaml.safe_load_all(subprocess.run(
        [kubectl, "kustomize", str(REPO / "deploy/k8s/overlays/monitoring-operator")],
        capture_output=True, text=True, check=True).stdout)
    (monitor,) = of_kind(list(docs), "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"]["serverName"] == SCRAPE_NAME
    assert endpoint["tlsConfig"]["ca"]["secret"] == {"name": "infermesh-ca-bundle", "key": "ca.crt"}


def test_every_kubernetes_service_certificate_carries_the_scrape_name(rendered):
    certificates = [c for c in of_kind(rendered["cpu"], "Certificate") if not c["spec"].get("isCA")]
    assert len(certificates) >= 3
    for certificate in certificates:
        assert SCRAPE_NAME in certificate["spec"]["dnsNames"], certificate["metadata"]["name"]


def test_compose_tls_init_issues_certificates_that_carry_the_scrape_name(tmp_path):
    """Runs tls-init's own dev_ca command (from compose.yaml) into a temporary folder."""
    tls_init = yaml.safe_load(COMPOSE.read_text())["services"]["tls-init"]
    command = shlex.split(tls_init["command"][0].split("&&")[0])
    assert command[:3] == ["python", "-m", "tools.dev_ca"]
    args = [tmp_path if a == "/etc/infermesh/tls" else a for a in command[3:]]
    subprocess.run([sys.executable, "-m", "tools.dev_ca", *map(str, args)], cwd=REPO, check=True,
                   capture_output=True, timeout=60)
    certificates = [p for p in tmp_path.glob("*.pem") if not p.name.endswith("-key.pem") and p.name != "ca.pem"]
    assert len(certificates) >= 3
    for path in certificates:
        names = x509.load_pem_x509_certificate(path.read_bytes()).extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
        assert SCRAPE_NAME in names, path.name
