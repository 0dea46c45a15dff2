"""Callers recognised by identity at a real gateway (issue 38): client certificates (SPIFFE id,
prefix, DNS name) and JWT bearer tokens, on the gRPC and the HTTP port of one gateway process.

The gateway requires client certificates (--tls-client-auth require) against a bundle of its own
CA and a clients' CA. Each tenant may use only a model of its own, so asking for model 'probe'
answers PERMISSION_DENIED naming the tenant the caller was recognised as: no scheduler is needed
to see who the gateway thinks is calling.
"""

from __future__ import annotations

import datetime as dt
import http.client
import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.support.tls_fixtures import DevPki, wait_tls_serving
from tools.dev_ca import DevCA, IssuedCert
from tools.testbed.jwt_issuer import ISSUER, TestIssuer, tampered
from tools.testbed.processes import ServiceProcess, free_port, running_mesh, wait_until

pytestmark = pytest.mark.integration

TRUST_DOMAIN = "clients.test"
KEY = "key-of-keyed-0123456789"


def tenants_yaml(jwks_path: Path) -> str:
    def tenant(tenant_id: str, how: str) -> str:
        return f"""
  - id: {tenant_id}
    priority: standard
    allowed_models: [only-{tenant_id}]
    quotas: {{requests_per_s: 1000, requests_burst: 1000, tokens_per_s: 1000, tokens_burst: 1000, max_in_flight: 50}}
    {how}"""
    from services.gateway.tenants.directory import hash_api_key
    return f"""
jwt:
  leeway_s: 5
  # Below aiohttp's own 8190-byte header line limit, so the HTTP port reaches this check too.
  max_token_bytes: 4096
  issuers:
    - issuer: "{ISSUER}"
      jwks_files: ["{jwks_path}"]
      audiences: [infermesh-gateway]
tenants:""" + "".join([
        tenant("search", f"identities: {{spiffe_ids: ['spiffe://{TRUST_DOMAIN}/ns/search/sa/api']}}"),
        tenant("batch", f"identities: {{spiffe_id_prefixes: ['spiffe://{TRUST_DOMAIN}/ns/batch/']}}"),
        tenant("legacy", "identities: {dns_names: [legacy.clients.test]}"),
        tenant("keyed", f"api_key_sha256: [{hash_api_key(KEY)}]"),
        tenant("tokened", f"identities: {{jwt: [{{issuer: '{ISSUER}', subject: svc-tokened}}]}}"),
    ])


class Setup:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.pki = DevPki.create(folder / "pki")
        self.clients = DevCA("clients CA")
        self.bundle = folder / "client-cas.pem"
        self.trust_clients(True)
        now = dt.datetime.now(dt.UTC)
        issue = self.clients.issue
        self.certs: dict[str, IssuedCert] = {
            "search": issue("search", uris=[f"spiffe://{TRUST_DOMAIN}/ns/search/sa/api"]),
            "batch": issue("batch", uris=[f"spiffe://{TRUST_DOMAIN}/ns/batch/sa/nightly"]),
            "legacy": issue("legacy", dns_names=["legacy.clients.test"]),
            "unmatched": issue("other", uris=[f"spiffe://{TRUST_DOMAIN}/ns/other/sa/x"]),
            "expired": issue("search", uris=[f"spiffe://{TRUST_DOMAIN}/ns/search/sa/api"],
                             not_before=now - dt.timedelta(days=2), not_after=now - dt.timedelta(days=1)),
            "wrong CA": DevCA("rogue CA").issue("search", uris=[f"spiffe://{TRUST_DOMAIN}/ns/search/sa/api"]),
        }
        self.issuer = TestIssuer()
        self.issuer.add_key("k1")
        self.jwks = folder / "jwks.json"
        self.issuer.write_jwks(self.jwks)
        self.tenants = folder / "tenants.yaml"
        self.tenants.write_text(tenants_yaml(self.jwks))

    def trust_clients(self, trusted: bool) -> None:
        text = self.pki.ca.cert_pem + (self.clients.cert_pem if trusted else b"")
        staging = self.bundle.with_name(".bundle.tmp")
        staging.write_bytes(text)
        staging.replace(self.bundle)

    def grpc_credentials(self, cert: str) -> grpc.ChannelCredentials:
        issued = self.certs[cert]
        return grpc.ssl_channel_credentials(self.pki.ca.cert_pem, issued.key_pem, issued.cert_pem)

    def https_context(self, cert: str) -> ssl.SSLContext:
        issued = self.certs[cert]
        cert_path, key_path = self.folder / f"{cert}.pem", self.folder / f"{cert}-key.pem"
        cert_path.write_bytes(issued.cert_pem)
        key_path.write_bytes(issued.key_pem)
        context = ssl.create_default_context(cadata=self.pki.ca.cert_pem.decode())
        context.load_cert_chain(cert_path, key_path)
        return context


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    return Setup(tmp_path_factory.mktemp("identity"))


@pytest.fixture(scope="module")
def gateway(setup, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("identity-gateway")
    files = setup.pki.files["gateway"]
    with running_mesh(tmp, tls=False) as mesh:  # the scheduler is never reached: answers come from admission
        scheduler = mesh.start_scheduler()
        process = ServiceProcess(
            "gateway", "gateway", free_port(),
            ["--scheduler-address", scheduler.address, "--metrics-port", str(free_port()), "--metrics-tls", "false",
             "--http-port", str(free_port()), "--tenants-file", str(setup.tenants),
             "--tls-cert-file", str(files.cert_path), "--tls-key-file", str(files.key_path),
             "--tls-ca-file", str(setup.bundle), "--tls-client-auth", "require"],
            {}, tmp / "gateway.log", tls=False)
        mesh.processes.append(process)
        process.start()
        wait_tls_serving(process, setup.grpc_credentials("unmatched"))
        process.http_port = int(process.args[process.args.index("--http-port") + 1])
        process.metrics_port = int(process.args[process.args.index("--metrics-port") + 1])
        yield process


def classify_probe(gateway, setup: Setup, cert: str, authorization: str | None = None) -> tuple[str, str]:
    """(status code name, message) of a Classify for model 'probe' over gRPC."""
    metadata = (("authorization", authorization),) if authorization else ()
    request = gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name="probe"), image=common_pb2.Image(
        raw=common_pb2.RawImage(pixels=bytes(12), height=2, width=2, channels=3)))
    with grpc.secure_channel(gateway.address, setup.grpc_credentials(cert)) as channel:
        try:
            gateway_pb2_grpc.InferenceStub(channel).Classify(request, timeout=5, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code().name, exc.details() or ""
    return "OK", ""


def completion_probe(gateway, setup: Setup, cert: str, authorization: str | None = None) -> tuple[str, str]:
    """(HTTP status, error message) of a completion for model 'probe' over HTTPS; ('handshake', ...) when
    the TLS handshake refused the certificate."""
    headers = {"Content-Type": "application/json"}
    if authorization:
        headers["Authorization"] = authorization
    request = urllib.request.Request(f"https://127.0.0.1:{gateway.http_port}/v1/completions", method="POST",
                                     data=json.dumps({"model": "probe", "prompt": "hi"}).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5, context=setup.https_context(cert)) as response:
            return str(response.status), ""
    except urllib.error.HTTPError as exc:
        return str(exc.code), json.loads(exc.read())["error"]["message"]
    except (urllib.error.URLError, ssl.SSLError, ConnectionError, http.client.RemoteDisconnected) as exc:
        return "handshake", str(exc)


def denied_as(tenant_id: str) -> str:
    return f"tenant '{tenant_id}' may not use model 'probe'"


# --------------------------------------------------------------------------- certificates


@pytest.mark.parametrize(("cert", "tenant_id"), [("search", "search"), ("batch", "batch"), ("legacy", "legacy")])
def test_a_matching_certificate_alone_is_its_tenant(gateway, setup, cert, tenant_id):
    assert classify_probe(gateway, setup, cert) == ("PERMISSION_DENIED", denied_as(tenant_id))
    assert completion_probe(gateway, setup, cert) == ("403", denied_as(tenant_id))


def test_an_unmatched_certificate_needs_a_key_and_then_the_key_decides(gateway, setup):
    code, message = classify_probe(gateway, setup, "unmatched")
    assert code == "UNAUTHENTICATED" and "matches no tenant" in message
    status, message = completion_probe(gateway, setup, "unmatched")
    assert status == "401" and "matches no tenant" in message
    assert classify_probe(gateway, setup, "unmatched", f"Bearer {KEY}") == ("PERMISSION_DENIED", denied_as("keyed"))
    assert completion_probe(gateway, setup, "unmatched", f"Bearer {KEY}") == ("403", denied_as("keyed"))


def test_a_certificate_and_a_key_of_different_tenants_are_denied_naming_both(gateway, setup):
    for code, message in (classify_probe(gateway, setup, "search", f"Bearer {KEY}"),
                          completion_probe(gateway, setup, "search", f"Bearer {KEY}")):
        assert code in ("PERMISSION_DENIED", "403")
        assert "tenant 'search'" in message and "tenant 'keyed'" in message and KEY not in message


@pytest.mark.parametrize("cert", ["expired", "wrong CA"])
def test_expired_and_foreign_certificates_fail_the_handshake(gateway, setup, cert):
    code, _ = classify_probe(gateway, setup, cert)
    assert code == "UNAVAILABLE"
    status, _ = completion_probe(gateway, setup, cert)
    assert status == "handshake"


# --------------------------------------------------------------------------- tokens


def test_a_valid_token_is_its_tenant(gateway, setup):
    token = setup.issuer.token("svc-tokened")
    assert classify_probe(gateway, setup, "unmatched", f"Bearer {token}") == ("PERMISSION_DENIED", denied_as("tokened"))
    assert completion_probe(gateway, setup, "unmatched", f"Bearer {token}") == ("403", denied_as("tokened"))


def bad_token(issuer: TestIssuer, case: str) -> str:
    claims = issuer.claims("svc-tokened")
    return {
        "expired": lambda: issuer.token(claims=issuer.claims("svc-tokened", now_s=claims["iat"] - 3600)),
        "not yet valid": lambda: issuer.token(claims={**claims, "nbf": claims["iat"] + 600}),
        "wrong audience": lambda: issuer.token(claims={**claims, "aud": "another-service"}),
        "wrong issuer": lambda: issuer.token(claims={**claims, "iss": "https://evil.test.invalid"}),
        "alg none": lambda: issuer.unsigned_token("svc-tokened"),
        "HS256 with the public key": lambda: issuer.hs256_with_public_key("svc-tokened"),
        "unknown kid": lambda: issuer.token("svc-tokened").replace(  # the header re-encoded with another kid
            issuer.token("svc-tokened").split(".")[0], _header_with_kid("k-unknown")),
        "tampered payload": lambda: tampered(issuer.token("svc-other"), sub="svc-tokened"),
        "oversized": lambda: issuer.token("svc-tokened", padding="x" * 5000),
    }[case]()


def _header_with_kid(kid: str) -> str:
    import base64
    header = json.dumps({"alg": "RS256", "typ": "JWT", "kid": kid}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(header).rstrip(b"=").decode()


@pytest.mark.parametrize(("case", "message"), [
    ("expired", "expired"),
    ("not yet valid", "not yet valid"),
    ("wrong audience", "wrong audience"),
    ("wrong issuer", "wrong issuer"),
    ("alg none", "algorithm 'none' is not allowed"),
    ("HS256 with the public key", "algorithm 'HS256' is not allowed"),
    ("unknown kid", "unknown signing key"),
    ("tampered payload", "bad signature"),
    ("oversized", "more than the limit"),
])
def test_bad_tokens_are_refused_naming_the_failure_not_the_token(gateway, setup, case, message):
    token = bad_token(setup.issuer, case)
    for code, said in (classify_probe(gateway, setup, "unmatched", f"Bearer {token}"),
                       completion_probe(gateway, setup, "unmatched", f"Bearer {token}")):
        assert code in ("UNAUTHENTICATED", "401"), (code, said)
        assert message in said
        assert all(len(part) < 8 or part not in said for part in token.split("."))


def test_jwks_rotation_takes_the_new_key_and_drops_the_removed_one(gateway, setup):
    old_token = setup.issuer.token("svc-tokened", kid="k1")
    assert classify_probe(gateway, setup, "unmatched", f"Bearer {old_token}")[1] == denied_as("tokened")
    setup.issuer.add_key("k2")
    setup.issuer.remove_key("k1")
    setup.issuer.write_jwks(setup.jwks)
    new_token = setup.issuer.token("svc-tokened", kid="k2")
    wait_until(lambda: classify_probe(gateway, setup, "unmatched", f"Bearer {new_token}")[1] == denied_as("tokened"),
               timeout_s=15, message="the new key accepted")
    code, message = classify_probe(gateway, setup, "unmatched", f"Bearer {old_token}")
    assert (code, "unknown signing key: kid 'k1'" in message) == ("UNAUTHENTICATED", True)
    status, message = completion_probe(gateway, setup, "unmatched", f"Bearer {old_token}")
    assert (status, "unknown signing key: kid 'k1'" in message) == ("401", True)


# --------------------------------------------------------------------------- metrics, logs, revocation


def test_metrics_and_logs_name_tenant_and_method_never_the_credential(gateway, setup):
    token = setup.issuer.token("svc-tokened", kid="k2")
    classify_probe(gateway, setup, "unmatched", f"Bearer {token}")
    text = urllib.request.urlopen(f"http://127.0.0.1:{gateway.metrics_port}/metrics", timeout=5).read().decode()
    for tenant_id, auth in (("search", "mtls"), ("batch", "mtls"), ("legacy", "mtls"), ("keyed", "key"),
                            ("tokened", "jwt")):
        assert f'infermesh_gateway_callers_total{{auth="{auth}",result="accepted",tenant="{tenant_id}"}}' in text
    assert 'infermesh_gateway_callers_total{auth="mtls+key",result="refused",tenant="unauthenticated"}' in text
    assert 'infermesh_gateway_callers_total{auth="mtls+jwt",result="refused",tenant="unauthenticated"}' in text
    log = gateway.log_path.read_text()
    for secret in (KEY, token.split(".")[2], token.split(".")[1]):
        assert secret not in text and secret not in log


def test_a_client_ca_removed_from_the_bundle_is_refused_without_a_restart(gateway, setup):
    setup.trust_clients(False)
    try:
        wait_until(lambda: classify_probe(gateway, setup, "search")[0] == "UNAVAILABLE", timeout_s=15,
                   message="gRPC refusing the removed CA")
        wait_until(lambda: completion_probe(gateway, setup, "search")[0] == "handshake", timeout_s=15,
                   message="HTTP refusing the removed CA")
    finally:
        setup.trust_clients(True)
    wait_until(lambda: classify_probe(gateway, setup, "search")[1] == denied_as("search"), timeout_s=15,
               message="gRPC trusting the CA again")
    wait_until(lambda: completion_probe(gateway, setup, "search")[1] == denied_as("search"), timeout_s=15,
               message="HTTP trusting the CA again")
