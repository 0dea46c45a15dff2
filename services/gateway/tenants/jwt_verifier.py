"""JWT bearer tokens: checked once with PyJWT, then remembered until they expire.

The checks, in order, each refusal UNAUTHENTICATED with a message that names what failed and
never the token: size (`max_token_bytes`), shape, issuer (one the tenants file trusts), the
algorithm (that issuer's allow-list: never `none`, never HMAC), the key (`kid` in that issuer's
JWKS, of a type that fits the algorithm), the signature, `exp`, `nbf` and `iat` with the stated
leeway, and `aud`. PyJWT (pinned in requirements.lock) does the signature and the claim checks.

A verified token is cached by its sha256 (never the token itself) with a bound of
`cache_entries`, least recently used out first: a token costs one signature check, not one per
request. A hit re-checks `exp` and `nbf` against the clock, and the cache belongs to one JWKS
generation, so a key removed from its file stops every token it signed at the next reload.
Refusals are remembered the same way (they hold while the keys and the tenants file do: a bad
signature, expired, an unknown kid, a wrong audience or issuer), so a replayed bad token costs a
hash, not a parse and a signature check (300 us for RS256 here) each time. "Not yet valid" is never
remembered: time lifts it.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jwt

from services.common.errors import Unauthenticated
from services.gateway.tenants.jwks import JwksFiles
from services.gateway.tenants.jwt_policy import JwtIssuer, JwtPolicy

_REQUIRED_CLAIMS = ["exp", "iat", "iss", "aud"]


def looks_like_jwt(token: str) -> bool:
    """Three base64url parts whose header is a JSON object ("eyJ" is the encoding of '{"')."""
    return token.startswith("eyJ") and token.count(".") == 2


@dataclass(frozen=True)
class VerifiedToken:
    issuer: str
    claims: Mapping[str, Any]
    expires_at_unix_s: float
    not_before_unix_s: float


def _refuse(problem: str) -> Unauthenticated:
    return Unauthenticated(f"invalid bearer token: {problem}")


class _NotYet(Unauthenticated):
    """The one refusal that time may lift: never remembered."""


def _remember(cache: OrderedDict, digest: bytes, value: object, bound: int) -> None:
    cache[digest] = value
    if len(cache) > bound:
        cache.popitem(last=False)  # the least recently used


def _shown(value: object) -> str:
    """A claim or header value in a message: short, so a huge or hostile value never fills a log line."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class JwtVerifier:
    def __init__(self, policy: JwtPolicy, jwks: JwksFiles, clock: Callable[[], float] = time.time) -> None:
        """clock: unix seconds, for the cache's exp and nbf re-checks (PyJWT checks a new token on its own clock)."""
        self.policy = policy
        self._jwks = jwks
        self._clock = clock
        self._cache: OrderedDict[bytes, VerifiedToken] = OrderedDict()
        self._refused: OrderedDict[bytes, str] = OrderedDict()  # digest -> the refusal's message
        self._generation = jwks.generation
        self.num_signature_checks = 0

    def verify(self, token: str) -> VerifiedToken:
        """The token's issuer and claims; raises Unauthenticated naming the failed check."""
        size = len(token.encode("utf-8", "surrogatepass"))
        if size > self.policy.max_token_bytes:
            raise _refuse(f"{size} bytes, more than the limit of {self.policy.max_token_bytes}")
        if self._generation != self._jwks.generation:  # the keys changed: nothing verified before counts
            self._cache.clear()
            self._refused.clear()
            self._generation = self._jwks.generation
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        cached = self._cache.get(digest)
        if cached is not None:
            self._check_times(cached)
            self._cache.move_to_end(digest)
            return cached
        refused = self._refused.get(digest)
        if refused is not None:
            raise Unauthenticated(refused)
        try:
            verified = self._verify_signature_and_claims(token)
        except _NotYet:
            raise
        except Unauthenticated as exc:
            _remember(self._refused, digest, exc.message, self.policy.cache_entries)
            raise
        _remember(self._cache, digest, verified, self.policy.cache_entries)
        return verified

    def _check_times(self, token: VerifiedToken) -> None:
        now_s = self._clock()
        if now_s > token.expires_at_unix_s + self.policy.leeway_s:
            raise _refuse(f"expired (exp is {now_s - token.expires_at_unix_s:.0f} s ago)")
        if now_s + self.policy.leeway_s < token.not_before_unix_s:
            raise _refuse("not yet valid (nbf is in the future)")

    def _verify_signature_and_claims(self, token: str) -> VerifiedToken:
        try:
            header = jwt.get_unverified_header(token)
            unverified = jwt.decode(token, options={"verify_signature": False})
        except jwt.PyJWTError:
            raise _refuse("malformed (not three base64url parts of JSON)") from None
        issuer = self._issuer_of(unverified.get("iss"))
        algorithm = header.get("alg")
        if algorithm not in issuer.algorithms:
            raise _refuse(f"algorithm {_shown(algorithm)} is not allowed for issuer {_shown(issuer.issuer)} "
                          f"(allowed: {', '.join(sorted(issuer.algorithms))})")
        key = self._key_for(issuer, header.get("kid"), algorithm)
        self.num_signature_checks += 1
        try:
            claims = jwt.decode(
                token, key, algorithms=[algorithm], audience=list(issuer.audiences), issuer=issuer.issuer,
                leeway=self.policy.leeway_s, options={"require": _REQUIRED_CLAIMS},
            )
        except jwt.ExpiredSignatureError:
            raise _refuse("expired (exp has passed)") from None
        except jwt.ImmatureSignatureError:
            raise _NotYet("invalid bearer token: not yet valid (nbf or iat is in the future)") from None
        except jwt.InvalidAudienceError:
            raise _refuse(f"wrong audience: this gateway accepts {', '.join(sorted(issuer.audiences))}") from None
        except jwt.InvalidIssuerError:
            raise _refuse(f"wrong issuer: expected {_shown(issuer.issuer)}") from None
        except jwt.InvalidSignatureError:
            raise _refuse("bad signature (the token was altered, or signed by another key)") from None
        except jwt.MissingRequiredClaimError as exc:
            raise _refuse(f"the '{exc.claim}' claim is missing") from None
        except jwt.InvalidIssuedAtError:
            raise _refuse("the 'iat' claim is not a number") from None
        except jwt.PyJWTError as exc:
            raise _refuse(f"{type(exc).__name__}") from None
        return VerifiedToken(issuer.issuer, claims, float(claims["exp"]), float(claims.get("nbf", 0)))

    def _issuer_of(self, name: object) -> JwtIssuer:
        if not isinstance(name, str):
            raise _refuse("the 'iss' claim is missing")
        issuer = self.policy.issuer(name)
        if issuer is None:
            raise _refuse(f"wrong issuer: {_shown(name)} is not an issuer the tenants file trusts")
        return issuer

    def _key_for(self, issuer: JwtIssuer, kid: object, algorithm: str) -> Any:
        keys = self._jwks.keys(issuer.jwks_files)
        if kid is None:
            if len(keys) != 1:
                raise _refuse(f"no 'kid' in the header, and issuer {_shown(issuer.issuer)} has {len(keys)} keys")
            (key,) = keys.values()
        else:
            found = keys.get(kid) if isinstance(kid, str) else None
            if found is None:
                raise _refuse(f"unknown signing key: kid {_shown(kid)} is not in the JWKS of issuer "
                              f"{_shown(issuer.issuer)}")
            key = found
        if not key.can_verify(algorithm):
            raise _refuse(f"key {_shown(key.kid)} ({key.kty}) cannot verify algorithm {algorithm}")
        return key.key
