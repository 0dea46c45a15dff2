"""JWT bearer tokens: every refusal names its check and never echoes the token; one signature
check per token (the cache), and JWKS rotation takes effect at the next poll, cached or not."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from services.common.errors import Unauthenticated
from services.gateway.tenants.jwks import JwksError, JwksFiles, parse_jwks
from services.gateway.tenants.jwt_policy import JwtIssuer, JwtPolicy
from services.gateway.tenants.jwt_verifier import JwtVerifier
from tools.testbed.jwt_issuer import AUDIENCE, ISSUER, TestIssuer, tampered


class WallClock:
    def __init__(self) -> None:
        self.now_s = time.time()

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def issuer() -> TestIssuer:
    issuer = TestIssuer()
    issuer.add_key("k1")
    issuer.add_key("e1", "ES256")
    return issuer


@pytest.fixture
def jwks_path(tmp_path: Path, issuer: TestIssuer) -> Path:
    path = tmp_path / "jwks.json"
    issuer.write_jwks(path)
    return path


def make_verifier(jwks_path: Path, clock=time.time, **policy) -> JwtVerifier:
    issuers = (JwtIssuer(ISSUER, (str(jwks_path),), frozenset({AUDIENCE}), frozenset({"RS256", "ES256"})),)
    policy = JwtPolicy(issuers=issuers, **{"leeway_s": 5.0, **policy})
    return JwtVerifier(policy, JwksFiles(policy.jwks_files), clock)


def test_accepts_a_valid_token_with_either_key(jwks_path, issuer):
    verifier = make_verifier(jwks_path)
    assert verifier.verify(issuer.token("svc-search", "k1")).claims["sub"] == "svc-search"
    assert verifier.verify(issuer.token("svc-other", "e1")).issuer == ISSUER


def forged(issuer: TestIssuer, case: str) -> str:
    now_s = time.time()
    return {
        "expired": lambda: issuer.token(claims=issuer.claims("s", now_s=now_s - 3600)),
        "not yet valid": lambda: issuer.token(claims=issuer.claims("s", nbf=int(now_s + 600))),
        "issued in the future": lambda: issuer.token(claims=issuer.claims("s", now_s=now_s + 600)),
        "wrong audience": lambda: issuer.token(claims={**issuer.claims("s"), "aud": "someone-else"}),
        "wrong issuer": lambda: issuer.token(claims={**issuer.claims("s"), "iss": "https://evil.invalid"}),
        "alg none": lambda: issuer.unsigned_token(),
        "hs256 with the public key": lambda: issuer.hs256_with_public_key(),
        "unknown kid": lambda: tampered_header_kid(issuer.token(), "k9"),
        "tampered payload": lambda: tampered(issuer.token("svc-batch"), sub="svc-search"),
        "oversized": lambda: issuer.token(padding="x" * 9000),
        "no exp": lambda: issuer.token(claims={k: v for k, v in issuer.claims("s").items() if k != "exp"}),
        "not a jwt": lambda: "eyJub3Q.a.jwt",
    }[case]()


def tampered_header_kid(token: str, kid: str) -> str:
    import base64
    header, payload, signature = token.split(".")
    data = json.loads(base64.urlsafe_b64decode(header + "=" * (-len(header) % 4)))
    data["kid"] = kid
    return f"{base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b'=').decode()}.{payload}.{signature}"


@pytest.mark.parametrize(("case", "message"), [
    ("expired", "expired"),
    ("not yet valid", "not yet valid"),
    ("issued in the future", "not yet valid"),
    ("wrong audience", "wrong audience: this gateway accepts infermesh-gateway"),
    ("wrong issuer", "wrong issuer: 'https://evil.invalid' is not an issuer the tenants file trusts"),
    ("alg none", "algorithm 'none' is not allowed"),
    ("hs256 with the public key", "algorithm 'HS256' is not allowed"),
    ("unknown kid", "unknown signing key: kid 'k9'"),
    ("tampered payload", "bad signature"),
    ("oversized", "more than the limit of 8192"),
    ("no exp", "the 'exp' claim is missing"),
    ("not a jwt", "malformed"),
])
def test_refuses_with_a_message_naming_the_failure_not_the_token(jwks_path, issuer, case, message):
    token = forged(issuer, case)
    with pytest.raises(Unauthenticated) as caught:
        make_verifier(jwks_path).verify(token)
    assert message in caught.value.message
    assert caught.value.message.startswith("invalid bearer token: ")
    for part in token.split("."):
        assert len(part) < 8 or part not in caught.value.message


def test_a_token_costs_one_signature_check(jwks_path, issuer):
    verifier = make_verifier(jwks_path)
    token = issuer.token()
    for _ in range(5):
        verifier.verify(token)
    assert verifier.num_signature_checks == 1


def test_a_cached_token_still_expires(jwks_path, issuer):
    clock = WallClock()
    verifier = make_verifier(jwks_path, clock)
    token = issuer.token(lifetime_s=60)
    verifier.verify(token)
    clock.now_s += 60 + 5 + 1  # past exp and the leeway
    with pytest.raises(Unauthenticated, match="expired"):
        verifier.verify(token)
    assert verifier.num_signature_checks == 1


def test_the_cache_is_bounded(jwks_path, issuer):
    verifier = make_verifier(jwks_path, cache_entries=2)
    first, second, third = (issuer.token(f"svc-{n}") for n in range(3))
    for token in (first, second, third, first):
        verifier.verify(token)
    assert verifier.num_signature_checks == 4  # `first` was evicted by `third`


def test_jwks_rotation_accepts_the_new_key_and_refuses_the_removed_one(jwks_path, issuer):
    verifier = make_verifier(jwks_path)
    old_token = issuer.token(kid="k1")
    verifier.verify(old_token)
    issuer.add_key("k2")
    issuer.remove_key("k1")
    issuer.write_jwks(jwks_path)
    new_token = issuer.token(kid="k2")
    with pytest.raises(Unauthenticated, match="unknown signing key"):  # not polled yet
        verifier.verify(new_token)
    assert verifier._jwks.poll().applied
    assert verifier.verify(new_token).claims["sub"] == "svc-search"
    with pytest.raises(Unauthenticated, match="unknown signing key: kid 'k1'"):  # though it was cached
        verifier.verify(old_token)


def test_a_bad_jwks_change_keeps_the_previous_keys_and_is_reported_once(jwks_path, issuer, caplog):
    verifier = make_verifier(jwks_path)
    jwks_path.write_text("{not json")
    assert verifier._jwks.poll().applied is False
    assert verifier._jwks.poll() is None
    assert verifier.verify(issuer.token()).issuer == ISSUER
    assert sum("refused JWKS change" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize(("jwk", "message"), [
    ({"kty": "RSA", "n": "AQAB", "e": "AQAB"}, "needs a 'kid'"),
    ({"kty": "oct", "kid": "s", "k": "c2VjcmV0"}, "kty must be one of"),
    ({"kty": "EC", "kid": "e", "alg": "RS256", "crv": "P-256", "x": "AA", "y": "AA"}, "does not fit a EC key"),
    ({"kty": "RSA", "kid": "r", "n": "AQAB", "e": "AQAB", "d": "AQAB"}, "holds a private key"),
])
def test_refuses_bad_jwks_naming_the_key(jwk, message):
    with pytest.raises(JwksError, match=message):
        parse_jwks(json.dumps({"keys": [jwk]}).encode(), "jwks.json")


def test_skips_encryption_keys():
    assert parse_jwks(b'{"keys": [{"kty": "RSA", "kid": "x", "use": "enc", "n": "AQAB", "e": "AQAB"}]}', "f") == {}


def test_a_replayed_bad_token_costs_one_signature_check(jwks_path, issuer):
    verifier = make_verifier(jwks_path)
    token = forged(issuer, "tampered payload")
    for _ in range(3):
        with pytest.raises(Unauthenticated, match="bad signature"):
            verifier.verify(token)
    assert verifier.num_signature_checks == 1


def test_a_token_not_yet_valid_is_checked_again_later(jwks_path, issuer):
    verifier = make_verifier(jwks_path)
    token = forged(issuer, "not yet valid")
    for _ in range(2):
        with pytest.raises(Unauthenticated, match="not yet valid"):
            verifier.verify(token)
    assert verifier.num_signature_checks == 2
