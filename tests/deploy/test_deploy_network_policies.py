"""NetworkPolicies: only the gateway is reachable from outside, nothing reaches a worker, only
gateways reach the quota store, Prometheus scrapes every service; evaluated with deploy_netpol over
the rendered manifests."""

from __future__ import annotations

import pytest
from deploy_manifests import OVERLAYS, by_name, infermesh_deployments, of_kind, quota_store, service_of
from deploy_netpol import Peer, can_connect, pod_of

OUTSIDE_CLUSTER = Peer("internet", None, ports={"https": (443, "TCP")})
OTHER_NAMESPACE_POD = Peer("shop-frontend", "shop", {"app": "frontend"})
PROMETHEUS = Peer("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"})
KUBE_DNS = Peer("coredns", "kube-system", {"k8s-app": "kube-dns"}, {"dns": (53, "UDP"), "dns-tcp": (53, "TCP")})


@pytest.fixture(scope="module", params=OVERLAYS)
def mesh(request, rendered):
    docs = rendered[request.param]
    pods: dict[str, list[Peer]] = {}
    for deployment in infermesh_deployments(docs):
        pods.setdefault(service_of(deployment), []).append(pod_of(deployment))
    pods["quota-store"] = [pod_of(quota_store(docs))]
    collector = pod_of(by_name(rendered["observability"], "Deployment", "otel-collector"))
    return of_kind(docs, "NetworkPolicy"), pods, collector


def every_pod(pods):
    return [pod for group in pods.values() for pod in group]


def service_pods(pods):
    """The gateway, scheduler and worker pods (not the store)."""
    return [pod for service, group in pods.items() if service != "quota-store" for pod in group]


def test_only_the_gateway_grpc_and_http_ports_are_reachable_from_outside_the_namespace(mesh):
    policies, pods, _ = mesh
    for outsider in (OUTSIDE_CLUSTER, OTHER_NAMESPACE_POD):
        for service, group in pods.items():
            for pod in group:
                for port_name in pod.ports:
                    allowed = can_connect(policies, outsider, pod, port_name)
                    expected = service == "gateway" and port_name in ("grpc", "http")
                    assert allowed == expected, f"{outsider.name} -> {pod.name}:{port_name}"


def test_nothing_but_prometheus_reaches_a_worker(mesh):
    policies, pods, _ = mesh
    sources = [OUTSIDE_CLUSTER, OTHER_NAMESPACE_POD, PROMETHEUS, *every_pod(pods)]
    for worker in pods["worker"]:
        for source in sources:
            for port_name in worker.ports:
                allowed = can_connect(policies, source, worker, port_name)
                assert allowed == (source is PROMETHEUS and port_name == "metrics"), f"{source.name} -> {worker.name}:{port_name}"


def test_gateway_and_workers_reach_the_scheduler_and_nothing_else_does(mesh):
    policies, pods, _ = mesh
    (scheduler,) = pods["scheduler"]
    for source in every_pod(pods):
        expected = service_of_peer(source) in ("gateway", "worker")
        assert can_connect(policies, source, scheduler, "grpc") == expected, source.name
    assert not can_connect(policies, OTHER_NAMESPACE_POD, scheduler, "grpc")


def test_only_gateways_reach_the_quota_store(mesh):
    policies, pods, _ = mesh
    (store,) = pods["quota-store"]
    assert set(store.ports) == {"valkey"}
    for source in [OUTSIDE_CLUSTER, OTHER_NAMESPACE_POD, PROMETHEUS, *every_pod(pods)]:
        expected = source.namespace == "infermesh" and source.labels.get("app.kubernetes.io/name") == "gateway"
        assert can_connect(policies, source, store, "valkey") == expected, f"{source.name} -> {store.name}"
    impostor = Peer("gateway-lookalike", "shop", {"app.kubernetes.io/name": "gateway"})
    assert not can_connect(policies, impostor, store, "valkey")


def test_prometheus_scrapes_every_service_and_nothing_else(mesh):
    policies, pods, _ = mesh
    for pod in service_pods(pods):
        assert can_connect(policies, PROMETHEUS, pod, "metrics"), pod.name
        if service_of_peer(pod) != "gateway":
            assert not can_connect(policies, PROMETHEUS, pod, "grpc"), pod.name
    impostor = Peer("prometheus-lookalike", "shop", {"app.kubernetes.io/name": "prometheus"})
    assert not any(can_connect(policies, impostor, pod, "metrics") for pod in service_pods(pods))


def test_pods_reach_dns_and_the_collector_but_not_the_internet(mesh):
    policies, pods, collector = mesh
    for pod in every_pod(pods):
        assert can_connect(policies, pod, KUBE_DNS, "dns"), pod.name
        assert can_connect(policies, pod, KUBE_DNS, "dns-tcp"), pod.name
        assert can_connect(policies, pod, collector, "otlp-grpc"), pod.name
        assert not can_connect(policies, pod, collector, "otlp-http"), pod.name
        assert not can_connect(policies, pod, OUTSIDE_CLUSTER, "https"), pod.name


def test_evaluator_isolates_a_pod_only_once_a_policy_selects_it(mesh):
    # Sanity check of deploy_netpol itself, which the assertions above rest on.
    policies, pods, _ = mesh
    default_deny = [p for p in policies if p["metadata"]["name"] == "default-deny"]
    (worker, *_) = pods["worker"]
    assert can_connect([], OUTSIDE_CLUSTER, worker, "grpc")
    assert not can_connect(default_deny, OUTSIDE_CLUSTER, worker, "grpc")
    assert not can_connect(default_deny, worker, KUBE_DNS, "dns")


def service_of_peer(peer: Peer) -> str:
    return peer.labels["app.kubernetes.io/name"]


def test_policies_select_pods_by_the_labels_the_deployments_carry(rendered):
    # A policy whose selector matches no pod protects nothing; catch renamed labels.
    docs = rendered["cpu"]
    workloads = [*infermesh_deployments(docs), quota_store(docs)]
    labels = [d["spec"]["template"]["metadata"]["labels"] for d in workloads]
    for policy in of_kind(docs, "NetworkPolicy"):
        wanted = policy["spec"]["podSelector"].get("matchLabels", {})
        assert any(wanted.items() <= pod.items() for pod in labels), policy["metadata"]["name"]
    assert {service_of(d) for d in infermesh_deployments(docs)} == {"gateway", "scheduler", "worker"}


def test_dns_egress_also_reaches_node_local_dns_cache(mesh):
    # NodeLocal DNSCache listens on a node link-local address, not in a pod: a kube-dns-only rule
    # leaves clusters that run it without name resolution.
    policies, _, _ = mesh
    dns_rules = [rule for policy in policies for rule in policy["spec"].get("egress", [])
                 if {p.get("port") for p in rule.get("ports", [])} == {53}]
    assert any({"cidr": "169.254.20.10/32"} in [peer.get("ipBlock") for peer in rule["to"]] for rule in dns_rules)
    for rule in dns_rules:  # still only DNS servers: no rule opens port 53 to everything
        assert rule.get("to"), "DNS egress to any address"
