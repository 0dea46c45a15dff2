"""A small NetworkPolicy evaluator: may this peer open a connection to that pod's port?

Implements the Kubernetes semantics the manifests rely on: a pod is isolated in a
direction once any policy selecting it lists that direction in policyTypes; then only
rules of those policies admit traffic (union). A connection needs the source's egress
and the destination's ingress to allow it. podSelector without namespaceSelector means
the policy's own namespace; `from`/`to`/`ports` left out means any. ipBlock is not used
by the manifests and so is not modelled; peers outside the cluster match only rules
with no peer list.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Peer:
    name: str
    # None: outside the cluster (no namespace, no labels, no policies of its own).
    namespace: str | None
    labels: Mapping[str, str] = field(default_factory=dict)
    # Named container ports: name -> (port, protocol).
    ports: Mapping[str, tuple[int, str]] = field(default_factory=dict)

    @property
    def namespace_labels(self) -> dict[str, str]:
        return {} if self.namespace is None else {"kubernetes.io/metadata.name": self.namespace}


def selector_matches(selector: Mapping | None, labels: Mapping[str, str]) -> bool:
    selector = selector or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        present = key in labels
        if operator == "In" and not (present and labels[key] in values):
            return False
        if operator == "NotIn" and present and labels[key] in values:
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
    return True


def _policy_types(policy: Mapping) -> list[str]:
    spec = policy["spec"]
    if "policyTypes" in spec:
        return spec["policyTypes"]
    return ["Ingress", *(["Egress"] if "egress" in spec else [])]


def _peer_matches(rule_peer: Mapping, policy_namespace: str, other: Peer) -> bool:
    if other.namespace is None:
        return False
    namespace_selector = rule_peer.get("namespaceSelector")
    if namespace_selector is None:
        namespace_ok = other.namespace == policy_namespace
    else:
        namespace_ok = selector_matches(namespace_selector, other.namespace_labels)
    pod_selector = rule_peer.get("podSelector")
    return namespace_ok and (pod_selector is None or selector_matches(pod_selector, other.labels))


def _port_matches(rule_ports: Iterable[Mapping] | None, port: int, port_name: str | None, protocol: str) -> bool:
    if not rule_ports:
        return True
    for rule_port in rule_ports:
        if rule_port.get("protocol", "TCP") != protocol:
            continue
        wanted = rule_port.get("port")
        if wanted is None or wanted == port or (port_name is not None and wanted == port_name):
            return True
    return False


def _allows(policies: Iterable[Mapping], direction: str, pod: Peer, other: Peer,
            port: int, port_name: str | None, protocol: str) -> bool:
    if pod.namespace is None:
        return True  # nothing outside the cluster is governed by these policies
    rules_key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    selecting = [
        p for p in policies
        if p["metadata"]["namespace"] == pod.namespace
        and selector_matches(p["spec"].get("podSelector"), pod.labels)
        and direction in _policy_types(p)
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get(rules_key) or []:
            peers = rule.get(peers_key)
            peer_ok = not peers or any(_peer_matches(r, policy["metadata"]["namespace"], other) for r in peers)
            if peer_ok and _port_matches(rule.get("ports"), port, port_name, protocol):
                return True
    return False


def can_connect(policies: Iterable[Mapping], source: Peer, destination: Peer, port_name: str) -> bool:
    """May `source` open a connection to `destination`'s named port?"""
    policies = list(policies)
    port, protocol = destination.ports[port_name]
    return (_allows(policies, "Egress", source, destination, port, port_name, protocol)
            and _allows(policies, "Ingress", destination, source, port, port_name, protocol))


def pod_of(deployment: Mapping) -> Peer:
    """The peer a Deployment's pods are, with all their containers' named ports."""
    template = deployment["spec"]["template"]
    ports = {
        p["name"]: (p["containerPort"], p.get("protocol", "TCP"))
        for container in template["spec"]["containers"] for p in container.get("ports", []) if "name" in p
    }
    return Peer(deployment["metadata"]["name"], deployment["metadata"]["namespace"],
                dict(template["metadata"].get("labels", {})), ports)
