"""Who a peer is (from its verified client certificate) and which methods it may call.

No grpc here: the interceptor in `authz.py` hands in the call's auth context (a plain
mapping of property name to byte strings, as `ServicerContext.auth_context()` returns
it) and the full method name, and turns a denial into PERMISSION_DENIED.

A peer's names are its SPIFFE id (the URI SAN `spiffe://<trust domain>/<path>`), then
any other URI SANs, then its DNS SANs. An allowed id matches if it equals any of them,
so an operator can authorize by SPIFFE id (cert-manager, SPIRE, Istio) or by DNS name.
The certificate chain itself was verified by the TLS handshake against the CA bundle;
only verified properties reach the auth context.

The policy fails closed: a method that is not in METHOD_ROLES is refused to everyone,
so a new RPC is unreachable under mTLS until someone decides who may call it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


class Role(enum.Enum):
    GATEWAY = "gateway"
    WORKER = "worker"
    OPERATOR = "operator"  # a person or tool reading a service's status (infermesh CLI)
    PEER = "peer"  # any peer whose certificate the CA bundle verifies


_SCHEDULER = "/infermesh.v1.Scheduler/"
_ADMIN = "/infermesh.v1.Admin/"
_OPEN_SERVICES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
    # The gateway's public services: tenants authenticate there with API keys, not certificates.
    "/infermesh.v1.Inference/",
    "/inference.GRPCInferenceService/",
)

_GATEWAY = frozenset({Role.GATEWAY})
_WORKER = frozenset({Role.WORKER})

# The one home of "who may call what". Full method names as gRPC reports them.
METHOD_ROLES: Mapping[str, frozenset[Role]] = {
    _SCHEDULER + "Classify": _GATEWAY,
    _SCHEDULER + "Generate": _GATEWAY,
    _SCHEDULER + "Submit": _GATEWAY,
    _SCHEDULER + "ListModels": _GATEWAY,
    _SCHEDULER + "Tokenize": _GATEWAY,
    _SCHEDULER + "Detokenize": _GATEWAY,
    _SCHEDULER + "GetTokenizerInfo": _GATEWAY,
    # Read-only load figures. Workers read them too: a worker given several schedulers probes
    # each one's GetPressure to attach where its model has the fewest workers (issue 12).
    _SCHEDULER + "GetPressure": frozenset({Role.GATEWAY, Role.WORKER}),
    _SCHEDULER + "Attach": _WORKER,
    # What a process has in force (services/common/admin_servicer.py), on every service's port.
    _ADMIN + "GetStatus": frozenset({Role.OPERATOR}),
    # A rollout's pause / resume / abort / promote by hand (the gateway's; others answer UNIMPLEMENTED).
    _ADMIN + "ControlRollout": frozenset({Role.OPERATOR}),
}

_DEV_GATEWAY_IDS = ("spiffe://infermesh/gateway",)
_DEV_WORKER_IDS = ("spiffe://infermesh/worker",)
_DEV_ADMIN_IDS = ("spiffe://infermesh/operator",)


@dataclass(frozen=True)
class PeerIdentity:
    """The verified names of a peer, most specific first (SPIFFE id, URIs, DNS names)."""

    names: tuple[str, ...]

    def __str__(self) -> str:
        return self.names[0] if self.names else "(a certificate without URI or DNS names)"


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str = ""  # why not, naming the peer and the method; empty when allowed


def _texts(values: Iterable[bytes]) -> list[str]:
    return [v.decode("utf-8", "replace") for v in values]


def peer_identity(auth_context: Mapping[str, Iterable[bytes]]) -> PeerIdentity | None:
    """The peer's identity, or None when the call came without a verified client certificate."""
    if b"ssl" not in auth_context.get("transport_security_type", ()) or "x509_pem_cert" not in auth_context:
        return None
    names: list[str] = []
    for key in ("peer_spiffe_id", "peer_uri", "peer_dns"):
        names += [n for n in _texts(auth_context.get(key, ())) if n not in names]
    return PeerIdentity(tuple(names))


@dataclass(frozen=True)
class IdentityPolicy:
    """Which identities hold each role; defaults fit the certificates `tools/dev_ca.py` issues."""

    gateway_ids: tuple[str, ...] = _DEV_GATEWAY_IDS
    worker_ids: tuple[str, ...] = _DEV_WORKER_IDS
    admin_ids: tuple[str, ...] = _DEV_ADMIN_IDS

    def _ids(self, role: Role) -> tuple[str, ...]:
        return {Role.GATEWAY: self.gateway_ids, Role.WORKER: self.worker_ids}.get(role, self.admin_ids)

    def roles_of(self, method: str) -> frozenset[Role]:
        """The roles that may call method; empty when nobody may."""
        if method.startswith(_OPEN_SERVICES):
            return frozenset({Role.PEER})
        return METHOD_ROLES.get(method, frozenset())

    def decide(self, method: str, peer: PeerIdentity | None) -> Decision:
        if peer is None:
            return Decision(False, f"{method} needs a verified client certificate; the call came without one")
        roles = self.roles_of(method)
        if not roles:
            return Decision(False, f"peer {peer} may not call {method}: no identity may call a method "
                                   "that is not in the identity policy (services/common/identity.py)")
        if Role.PEER in roles:
            return Decision(True)
        ordered = [role for role in Role if role in roles]
        allowed = [i for role in ordered for i in self._ids(role)]
        if any(name in allowed for name in peer.names):
            return Decision(True)
        holders = " or ".join(f"{'an' if role.value[0] in 'aeiou' else 'a'} {role.value}" for role in ordered)
        return Decision(False, f"peer {peer} may not call {method}: only {holders} identity "
                               f"({', '.join(allowed)}) may")
