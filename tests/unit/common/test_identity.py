"""Peer identity from a verified auth context, and which identity may call which method (identity.py)."""

from __future__ import annotations

import pytest

from infermesh.v1 import admin_pb2, scheduler_pb2
from services.common.identity import METHOD_ROLES, IdentityPolicy, PeerIdentity, Role, peer_identity

GATEWAY = PeerIdentity(("spiffe://infermesh/gateway", "gateway", "localhost"))
WORKER = PeerIdentity(("spiffe://infermesh/worker", "worker", "localhost"))
SCHEDULER_METHODS = ["Classify", "Generate", "Submit", "ListModels", "Tokenize", "Detokenize", "GetTokenizerInfo"]


def _auth_context(**properties: list[bytes]) -> dict[str, list[bytes]]:
    return {"transport_security_type": [b"ssl"], "x509_pem_cert": [b"-----BEGIN CERTIFICATE-----"], **properties}


def test_identity_lists_the_spiffe_id_first_then_other_uris_then_dns_names():
    context = _auth_context(
        peer_spiffe_id=[b"spiffe://infermesh/gateway"],
        peer_uri=[b"spiffe://infermesh/gateway", b"https://example.invalid/x"],
        peer_dns=[b"gateway.infermesh.svc"],
    )
    identity = peer_identity(context)
    assert identity.names == ("spiffe://infermesh/gateway", "https://example.invalid/x", "gateway.infermesh.svc")
    assert str(identity) == "spiffe://infermesh/gateway"


def test_no_identity_without_a_verified_certificate():
    assert peer_identity({}) is None
    assert peer_identity({"transport_security_type": [b"insecure"]}) is None
    assert peer_identity({"transport_security_type": [b"ssl"]}) is None  # TLS without a client certificate


def test_a_certificate_without_names_is_an_identity_that_holds_no_role():
    identity = peer_identity(_auth_context())
    assert identity == PeerIdentity(())
    decision = IdentityPolicy().decide("/infermesh.v1.Scheduler/ListModels", identity)
    assert not decision.allowed
    assert "a certificate without URI or DNS names" in decision.reason


@pytest.mark.parametrize("method", SCHEDULER_METHODS)
def test_only_the_gateway_may_call_the_schedulers_request_methods(method):
    policy = IdentityPolicy()
    full = f"/infermesh.v1.Scheduler/{method}"
    assert policy.decide(full, GATEWAY).allowed
    denied = policy.decide(full, WORKER)
    assert not denied.allowed
    assert denied.reason == (f"peer spiffe://infermesh/worker may not call {full}: "
                             "only a gateway identity (spiffe://infermesh/gateway) may")


def test_gateways_and_workers_may_read_pressure_and_nobody_else():
    # Workers given several schedulers probe GetPressure to pick the emptiest (issue 12).
    policy = IdentityPolicy()
    method = "/infermesh.v1.Scheduler/GetPressure"
    assert policy.decide(method, GATEWAY).allowed
    assert policy.decide(method, WORKER).allowed
    denied = policy.decide(method, PeerIdentity(("spiffe://infermesh/scheduler",)))
    assert denied.reason == (f"peer spiffe://infermesh/scheduler may not call {method}: only a gateway or a worker "
                             "identity (spiffe://infermesh/gateway, spiffe://infermesh/worker) may")


def test_only_a_worker_may_attach():
    policy = IdentityPolicy()
    assert policy.decide("/infermesh.v1.Scheduler/Attach", WORKER).allowed
    denied = policy.decide("/infermesh.v1.Scheduler/Attach", GATEWAY)
    assert denied.reason == ("peer spiffe://infermesh/gateway may not call /infermesh.v1.Scheduler/Attach: "
                             "only a worker identity (spiffe://infermesh/worker) may")


@pytest.mark.parametrize("method", [
    "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
])
def test_health_and_reflection_are_open_to_every_authenticated_peer(method):
    assert IdentityPolicy().decide(method, WORKER).allowed
    assert not IdentityPolicy().decide(method, None).allowed


def test_methods_outside_the_policy_are_refused_to_everyone():
    decision = IdentityPolicy().decide("/infermesh.v1.Scheduler/DropEverything", GATEWAY)
    assert not decision.allowed
    assert "not in the identity policy" in decision.reason


def test_configured_ids_may_be_dns_names():
    policy = IdentityPolicy(gateway_ids=("gateway.infermesh.svc",), worker_ids=("spiffe://prod/worker/digits",))
    gateway = PeerIdentity(("spiffe://prod/gateway", "gateway.infermesh.svc"))
    assert policy.decide("/infermesh.v1.Scheduler/Classify", gateway).allowed
    assert not policy.decide("/infermesh.v1.Scheduler/Classify", GATEWAY).allowed


def test_every_scheduler_rpc_has_a_role():
    # Fail closed: a new Scheduler RPC is refused under mTLS until METHOD_ROLES says who may call it.
    service = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"]
    missing = [m.name for m in service.methods if f"/{service.full_name}/{m.name}" not in METHOD_ROLES]
    assert not missing, f"add {missing} to METHOD_ROLES in services/common/identity.py"
    assert all(roles and roles <= {Role.GATEWAY, Role.WORKER, Role.OPERATOR} for roles in METHOD_ROLES.values())


def test_only_an_operator_identity_may_read_a_services_status():
    method = "/infermesh.v1.Admin/GetStatus"
    operator = PeerIdentity(("spiffe://infermesh/operator",))
    assert IdentityPolicy().decide(method, operator).allowed
    for peer in (GATEWAY, WORKER):
        decision = IdentityPolicy().decide(method, peer)
        assert not decision.allowed
        assert "only an operator identity (spiffe://infermesh/operator) may" in decision.reason
    assert IdentityPolicy(admin_ids=("spiffe://infermesh/gateway",)).decide(method, GATEWAY).allowed


def test_every_admin_rpc_has_a_role():
    service = admin_pb2.DESCRIPTOR.services_by_name["Admin"]
    missing = [m.name for m in service.methods if f"/{service.full_name}/{m.name}" not in METHOD_ROLES]
    assert not missing, f"add {missing} to METHOD_ROLES in services/common/identity.py"
