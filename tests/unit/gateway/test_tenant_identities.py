"""Tenants recognised by certificate names and JWT claims: the file's rules, their strict
validation, and the one check that combines them with API keys (TenantDirectory.recognize)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.errors import PermissionDenied, Unauthenticated
from services.common.identity import PeerIdentity
from services.gateway.tenants.credentials import AuthMethod, Credentials
from services.gateway.tenants.directory import (
    TenantConfigError,
    TenantConfigWatcher,
    TenantDirectory,
    hash_api_key,
    parse_tenant_config,
)
from tools.testbed.jwt_issuer import TestIssuer

QUOTAS = """
    quotas: {requests_per_s: 10, requests_burst: 10, tokens_per_s: 100, tokens_burst: 100, max_in_flight: 4}"""


def tenant(tenant_id: str, identities: str = "", key: str | None = None) -> str:
    text = f"\n  - id: {tenant_id}\n    priority: standard\n    allowed_models: '*'{QUOTAS}"
    if key is not None:
        text += f"\n    api_key_sha256: [{hash_api_key(key)}]"
    if identities:
        text += "\n    identities:\n" + "\n".join(f"      {line}" for line in identities.strip().splitlines())
    return text


def jwt_section(jwks_path: str = "/nonexistent/jwks.json", extra: str = "") -> str:
    return f"""
jwt:
  leeway_s: 5
  issuers:
    - issuer: "https://idp.test.invalid/realms/mesh"
      jwks_files: ["{jwks_path}"]
      audiences: [infermesh-gateway]{extra}
"""


def parse(*tenants: str, head: str = ""):
    return parse_tenant_config(head + "tenants:" + "".join(tenants), "t.yaml")


def peer(*names: str) -> PeerIdentity:
    return PeerIdentity(names)


# --------------------------------------------------------------------------- parsing


def test_parses_certificate_and_token_identities():
    config = parse(tenant("search", """
spiffe_ids: ["spiffe://prod.example/ns/search/sa/api"]
spiffe_id_prefixes: ["spiffe://prod.example/ns/batch/"]
dns_names: [search.internal.example]
jwt:
  - {issuer: "https://idp.test.invalid/realms/mesh", subject: svc-search}
  - {issuer: "https://idp.test.invalid/realms/mesh", claim: team, value: search}
"""), head=jwt_section())
    (search,) = config.tenants
    assert search.identities.spiffe_ids == ("spiffe://prod.example/ns/search/sa/api",)
    assert search.identities.spiffe_id_prefixes == ("spiffe://prod.example/ns/batch/",)
    assert search.identities.dns_names == ("search.internal.example",)
    assert search.api_key_sha256 == ()
    assert config.jwt.leeway_s == 5
    assert config.jwt.issuers[0].algorithms == frozenset({"RS256", "ES256"})


@pytest.mark.parametrize(("identities", "head", "message"), [
    ("spiffe_ids: ['spiffe://Prod/ns/a']", "", "identities.spiffe_ids[0]': must be a SPIFFE id"),
    ("spiffe_ids: ['spiffe://prod/ns/a/']", "", "goes in spiffe_id_prefixes"),
    ("spiffe_ids: ['spiffe://prod/ns/../admin']", "", "must be a SPIFFE id"),
    ("spiffe_ids: ['https://prod/ns/a']", "", "must be a SPIFFE id"),
    ("spiffe_id_prefixes: ['spiffe://prod/ns/sea']", "", "ending in '/'"),
    ("spiffe_id_prefixes: ['spiffe://']", "", "spiffe_id_prefixes[0]'"),
    ("dns_names: ['*.example']", "", "without wildcards"),
    ("dns_names: [Search.example]", "", "lowercase DNS name"),
    ("dns_names: [a.example, a.example]", "", "listed twice"),
    ("dns_names: ['10.0.0.1']", "", "not an IP address"),
    ("spiffe_ids: []", "", "names no identity"),
    ("colour: blue", "", "identities.colour': unknown field"),
    ("jwt: [{issuer: x, subject: y}]", "", "issuer 'x' is not in the file's jwt.issuers"),
    ("jwt: [{issuer: x, claim: aud, value: y}]", "", "'aud' cannot pick a tenant"),
    ("jwt: [{issuer: x, subject: y, claim: team}]", "", "exactly issuer and subject"),
])
def test_refuses_bad_identities_naming_tenant_and_field(identities, head, message):
    with pytest.raises(TenantConfigError, match="tenant 'search'") as caught:
        parse(tenant("search", identities), head=head)
    assert message in str(caught.value)


def test_a_tenant_needs_a_key_or_an_identity():
    with pytest.raises(TenantConfigError, match="field 'api_key_sha256': is required unless 'identities'"):
        parse(tenant("nobody"))


def test_refuses_one_identity_for_two_tenants():
    with pytest.raises(TenantConfigError, match="dns_names 'a.example' is also tenant 'one''s"):
        parse(tenant("one", "dns_names: [a.example]"), tenant("two", "dns_names: [a.example]"))


@pytest.mark.parametrize(("section", "message"), [
    ("jwt: {issuers: []}", "field 'jwt.issuers': must be a non-empty list"),
    ("jwt: {leeway_s: 900, issuers: []}", "field 'jwt.leeway_s'"),
    ("jwt: {issuers: [{issuer: a, jwks_files: [f], audiences: [g], algorithms: [none]}]}", "a token must be signed"),
    ("jwt: {issuers: [{issuer: a, jwks_files: [f], audiences: [g], algorithms: [HS256]}]}",
     "HMAC would let a public key be used as the shared secret"),
    ("jwt: {issuers: [{issuer: a, jwks_files: [f]}]}", "jwt.issuers[0].audiences"),
    ("jwt: {issuers: [{issuer: a, audiences: [g]}]}", "jwt.issuers[0].jwks_files"),
    ("jwt: {issuers: [{issuer: a, jwks_files: [f], audiences: [g], url: x}]}", "jwt.issuers[0].url': unknown field"),
    ("jwt: {max_token_bytes: 10, issuers: [{issuer: a, jwks_files: [f], audiences: [g]}]}", "jwt.max_token_bytes"),
])
def test_refuses_bad_jwt_sections(section, message):
    with pytest.raises(TenantConfigError) as caught:
        parse(tenant("search", key="k"), head=section + "\n")
    assert message in str(caught.value)


# --------------------------------------------------------------------------- certificates


@pytest.fixture
def directory() -> TenantDirectory:
    config = parse(
        tenant("exact", "spiffe_ids: ['spiffe://prod.example/ns/search/sa/api']", key="key-exact"),
        tenant("namespace", "spiffe_id_prefixes: ['spiffe://prod.example/ns/search/']"),
        tenant("cluster", "spiffe_id_prefixes: ['spiffe://prod.example/']"),
        tenant("legacy", "dns_names: [legacy.internal.example]"),
        tenant("keyed", key="key-keyed"),
    )
    return TenantDirectory(config)


@pytest.mark.parametrize(("names", "expected"), [
    (("spiffe://prod.example/ns/search/sa/api",), "exact"),  # exact beats both prefixes
    (("spiffe://prod.example/ns/search/sa/indexer",), "namespace"),  # the longest prefix
    (("spiffe://prod.example/ns/searchx/sa/a",), "cluster"),  # a prefix never cuts a segment
    (("spiffe://other.example/ns/search/sa/api", "legacy.internal.example"), "legacy"),  # then DNS
    (("spiffe://prod.example/ns/a", "legacy.internal.example"), "cluster"),  # SPIFFE before DNS
    (("LEGACY.internal.example",), "legacy"),
])
def test_a_certificate_alone_is_its_tenant(directory, names, expected):
    recognition = directory.recognize(Credentials(None, peer(*names)))
    assert (recognition.tenant.tenant_id, recognition.method) == (expected, AuthMethod.MTLS)


def test_an_unmatched_certificate_without_a_key_is_unauthenticated(directory):
    with pytest.raises(Unauthenticated, match=r"client certificate \(spiffe://other/x\) matches no tenant"):
        directory.recognize(Credentials(None, peer("spiffe://other/x")))


def test_an_unmatched_certificate_leaves_the_choice_to_the_key(directory):
    recognition = directory.recognize(Credentials("Bearer key-keyed", peer("spiffe://other/x")))
    assert (recognition.tenant.tenant_id, recognition.method) == ("keyed", AuthMethod.KEY)


def test_a_certificate_and_a_key_of_one_tenant_are_both_counted(directory):
    recognition = directory.recognize(Credentials("Bearer key-exact", peer("spiffe://prod.example/ns/search/sa/api")))
    assert (recognition.tenant.tenant_id, recognition.method) == ("exact", AuthMethod.MTLS_KEY)


def test_a_certificate_and_a_key_of_different_tenants_is_denied_naming_both(directory):
    with pytest.raises(PermissionDenied) as caught:
        directory.recognize(Credentials("Bearer key-keyed", peer("spiffe://prod.example/ns/search/sa/api")))
    assert "tenant 'exact'" in caught.value.message and "tenant 'keyed'" in caught.value.message
    assert "key-keyed" not in caught.value.message


def test_a_certificate_whose_names_point_at_two_tenants_is_denied():
    directory = TenantDirectory(parse(tenant("a", "dns_names: [a.example]"), tenant("b", "dns_names: [b.example]")))
    with pytest.raises(PermissionDenied, match="tenants 'a' and 'b' equally"):
        directory.recognize(Credentials(None, peer("a.example", "b.example")))


def test_a_plain_string_is_still_an_api_key(directory):
    assert directory.authenticate("Bearer key-keyed").tenant_id == "keyed"
    with pytest.raises(Unauthenticated, match="missing API key"):
        directory.authenticate(None)


# --------------------------------------------------------------------------- tokens


@pytest.fixture
def issuer() -> TestIssuer:
    issuer = TestIssuer()
    issuer.add_key("k1")
    return issuer


def token_directory(tmp_path: Path, issuer: TestIssuer) -> TenantDirectory:
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps(issuer.jwks()))
    return TenantDirectory(parse(
        tenant("search", "jwt: [{issuer: 'https://idp.test.invalid/realms/mesh', subject: svc-search}]"),
        tenant("team-a", "jwt: [{issuer: 'https://idp.test.invalid/realms/mesh', claim: team, value: a}]"),
        tenant("azp-b", "jwt: [{issuer: 'https://idp.test.invalid/realms/mesh', claim: azp, value: b}]"),
        tenant("cert", "spiffe_ids: ['spiffe://prod/ns/x']"),
        head=jwt_section(str(jwks))))


def test_tokens_name_tenants_by_subject_then_claim(tmp_path, issuer):
    directory = token_directory(tmp_path, issuer)
    by_subject = directory.recognize(f"Bearer {issuer.token('svc-search', team='a')}")
    assert (by_subject.tenant.tenant_id, by_subject.method) == ("search", AuthMethod.JWT)
    assert directory.authenticate(f"Bearer {issuer.token('svc-other', team='a')}").tenant_id == "team-a"
    assert directory.authenticate(f"Bearer {issuer.token('svc-other', groups=['x'], azp='b')}").tenant_id == "azp-b"


def test_a_token_whose_claims_point_at_two_tenants_is_denied(tmp_path, issuer):
    directory = token_directory(tmp_path, issuer)
    with pytest.raises(PermissionDenied, match="tenants 'azp-b' and 'team-a' equally"):
        directory.authenticate(f"Bearer {issuer.token('svc-other', team='a', azp='b')}")


def test_a_valid_token_of_no_tenant_is_unauthenticated(tmp_path, issuer):
    with pytest.raises(Unauthenticated, match="valid but matches no tenant"):
        token_directory(tmp_path, issuer).authenticate(f"Bearer {issuer.token('svc-nobody')}")


def test_a_certificate_and_a_token_of_different_tenants_is_denied(tmp_path, issuer):
    directory = token_directory(tmp_path, issuer)
    with pytest.raises(PermissionDenied, match="is tenant 'cert' but the token is tenant 'search'"):
        directory.recognize(Credentials(f"Bearer {issuer.token('svc-search')}", peer("spiffe://prod/ns/x")))


def test_a_jwt_without_a_trusted_issuer_is_an_invalid_key(issuer):
    directory = TenantDirectory(parse(tenant("keyed", key="k")))
    with pytest.raises(Unauthenticated, match="trusts no token issuer"):
        directory.authenticate(f"Bearer {issuer.token()}")


def test_a_missing_jwks_file_is_a_config_error(tmp_path, issuer):
    path = tmp_path / "t.yaml"
    path.write_text(jwt_section(str(tmp_path / "absent.json")) + "tenants:" + tenant("keyed", key="k"))
    with pytest.raises(TenantConfigError, match="field 'jwt': .*absent.json: cannot read"):
        TenantConfigWatcher(path)
