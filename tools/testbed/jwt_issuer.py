"""A throwaway token issuer for tests and benchmarks: keys, their JWKS, and tokens good and bad.

Keys are made with `cryptography` and tokens signed with PyJWT, as a real identity provider's
would be; the forgeries (`alg: none`, HS256 keyed with the public key, a tampered payload) are
built by hand, because PyJWT refuses to make them. Nothing here is for production.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import time
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

ISSUER = "https://idp.test.invalid/realms/mesh"
AUDIENCE = "infermesh-gateway"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


class TestIssuer:
    """Signs tokens with one key per kid; `jwks()` is what the gateway's JWKS file holds."""

    __test__ = False  # not a pytest class

    def __init__(self, issuer: str = ISSUER, audience: str = AUDIENCE) -> None:
        self.issuer = issuer
        self.audience = audience
        self._keys: dict[str, Any] = {}
        self._algorithms: dict[str, str] = {}

    def add_key(self, kid: str, algorithm: str = "RS256") -> None:
        if algorithm.startswith(("RS", "PS")):
            self._keys[kid] = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        elif algorithm == "ES256":
            self._keys[kid] = ec.generate_private_key(ec.SECP256R1())
        else:
            raise ValueError(f"no test key for {algorithm}")
        self._algorithms[kid] = algorithm

    def remove_key(self, kid: str) -> None:
        del self._keys[kid]
        del self._algorithms[kid]

    def jwks(self) -> dict[str, Any]:
        keys = []
        for kid, key in self._keys.items():
            codec = ECAlgorithm if isinstance(key, ec.EllipticCurvePrivateKey) else RSAAlgorithm
            jwk = codec.to_jwk(key.public_key(), as_dict=True)
            keys.append({**jwk, "kid": kid, "use": "sig"})
        return {"keys": keys}

    def write_jwks(self, path: Path) -> None:
        """Atomically, as a fetcher or a Secret volume replaces the file."""
        staging = path.with_name(f".{path.name}.tmp")
        staging.write_text(json.dumps(self.jwks()))
        os.replace(staging, path)

    def claims(self, subject: str, now_s: float | None = None, lifetime_s: float = 600, **extra: Any) -> dict:
        now_s = time.time() if now_s is None else now_s
        return {"iss": self.issuer, "sub": subject, "aud": self.audience, "iat": int(now_s),
                "exp": int(now_s + lifetime_s), **extra}

    def token(self, subject: str = "svc-search", kid: str | None = None, *, claims: dict | None = None,
              **extra: Any) -> str:
        kid = kid or next(iter(self._keys))
        payload = claims if claims is not None else self.claims(subject, **extra)
        return jwt.encode(payload, self._keys[kid], algorithm=self._algorithms[kid], headers={"kid": kid})

    def public_pem(self, kid: str) -> bytes:
        return self._keys[kid].public_key().public_bytes(serialization.Encoding.PEM,
                                                         serialization.PublicFormat.SubjectPublicKeyInfo)

    # -- forgeries ------------------------------------------------------------------------

    def unsigned_token(self, subject: str = "svc-search", kid: str | None = None) -> str:
        """`alg: none` with an empty signature."""
        header = {"alg": "none", "typ": "JWT", "kid": kid or next(iter(self._keys))}
        return f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(self.claims(subject)).encode())}."

    def hs256_with_public_key(self, subject: str = "svc-search", kid: str | None = None) -> str:
        """HS256 keyed with the issuer's public key PEM: the classic algorithm-confusion forgery."""
        kid = kid or next(iter(self._keys))
        header = _b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": kid}).encode())
        payload = _b64(json.dumps(self.claims(subject)).encode())
        signature = hmac.new(self.public_pem(kid), f"{header}.{payload}".encode(), hashlib.sha256).digest()
        return f"{header}.{payload}.{_b64(signature)}"


def tampered(token: str, **changes: Any) -> str:
    """The token with its payload changed and the original signature kept."""
    header, payload, signature = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    claims.update(changes)
    return f"{header}.{_b64(json.dumps(claims).encode())}.{signature}"
