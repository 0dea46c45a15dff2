"""The tenants file's `jwt` section: which issuers' tokens the gateway accepts, and how it checks them.

    jwt:
      leeway_s: 30            # clock skew allowed on exp, nbf and iat (default 30, at most 300)
      max_token_bytes: 8192   # a longer bearer token is refused before it is parsed
      cache_entries: 10000    # verified tokens remembered (one signature check per token, not per request)
      issuers:
        - issuer: "https://idp.example/realms/mesh"   # the token's iss, exactly
          jwks_files: ["/etc/infermesh/jwks/idp.json"] # written by `python -m services.gateway.tenants fetch-jwks`
          audiences: ["infermesh-gateway"]              # the token's aud must hold one of these
          algorithms: ["RS256", "ES256"]                # default RS256 and ES256

Only asymmetric algorithms are accepted: `none` and the HMAC family are refused at parse time, so
a token can never be checked with a public key used as an HMAC secret.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

# What PyJWT verifies with `cryptography`; RSA, RSA-PSS, ECDSA and Ed25519/Ed448.
ASYMMETRIC_ALGORITHMS = frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512",
                                   "ES256", "ES384", "ES512", "EdDSA"})
DEFAULT_ALGORITHMS = ("RS256", "ES256")
DEFAULT_LEEWAY_S = 30.0
MAX_LEEWAY_S = 300.0
DEFAULT_MAX_TOKEN_BYTES = 8192
DEFAULT_CACHE_ENTRIES = 10_000
_FIELDS = ("leeway_s", "max_token_bytes", "cache_entries", "issuers")
_ISSUER_FIELDS = ("issuer", "jwks_files", "audiences", "algorithms")

Fail = Callable[[str, str], Exception]


@dataclass(frozen=True)
class JwtIssuer:
    issuer: str
    jwks_files: tuple[str, ...]
    audiences: frozenset[str]
    algorithms: frozenset[str]


@dataclass(frozen=True)
class JwtPolicy:
    issuers: tuple[JwtIssuer, ...] = ()
    leeway_s: float = DEFAULT_LEEWAY_S
    max_token_bytes: int = DEFAULT_MAX_TOKEN_BYTES
    cache_entries: int = DEFAULT_CACHE_ENTRIES

    def issuer(self, name: str) -> JwtIssuer | None:
        return next((i for i in self.issuers if i.issuer == name), None)

    @property
    def jwks_files(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(path for i in self.issuers for path in i.jwks_files))


NO_JWT = JwtPolicy()


def parse_jwt_policy(value: object, fail: Fail) -> JwtPolicy:
    """The `jwt` mapping; `fail(field, problem)` makes the error naming the file."""
    if value is None:
        return NO_JWT
    if not isinstance(value, Mapping):
        raise fail("jwt", f"must be a mapping with {', '.join(_FIELDS)}")
    unknown = sorted(str(k) for k in value if k not in _FIELDS)
    if unknown:
        raise fail(f"jwt.{unknown[0]}", f"unknown field (expected one of {', '.join(_FIELDS)})")
    leeway_s = value.get("leeway_s", DEFAULT_LEEWAY_S)
    if isinstance(leeway_s, bool) or not isinstance(leeway_s, int | float) or not 0 <= leeway_s <= MAX_LEEWAY_S:
        raise fail("jwt.leeway_s", f"must be a number of seconds from 0 to {MAX_LEEWAY_S:g}, got {leeway_s!r}")
    issuers = value.get("issuers")
    if not isinstance(issuers, list) or not issuers:
        raise fail("jwt.issuers", "must be a non-empty list of issuers")
    parsed = tuple(_parse_issuer(item, f"jwt.issuers[{index}]", fail) for index, item in enumerate(issuers))
    names = [i.issuer for i in parsed]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise fail(f"jwt.issuers[{index}].issuer", f"{name!r} is listed twice")
    return JwtPolicy(
        issuers=parsed,
        leeway_s=float(leeway_s),
        max_token_bytes=_positive_int(value.get("max_token_bytes", DEFAULT_MAX_TOKEN_BYTES), "jwt.max_token_bytes",
                                      256, fail),
        cache_entries=_positive_int(value.get("cache_entries", DEFAULT_CACHE_ENTRIES), "jwt.cache_entries", 1, fail),
    )


def _parse_issuer(item: object, where: str, fail: Fail) -> JwtIssuer:
    if not isinstance(item, Mapping):
        raise fail(where, f"must be a mapping with {', '.join(_ISSUER_FIELDS)}")
    unknown = sorted(str(k) for k in item if k not in _ISSUER_FIELDS)
    if unknown:
        raise fail(f"{where}.{unknown[0]}", f"unknown field (expected one of {', '.join(_ISSUER_FIELDS)})")
    issuer = item.get("issuer")
    if not isinstance(issuer, str) or not issuer.strip():
        raise fail(f"{where}.issuer", f"must be the issuer's name as tokens carry it in 'iss', got {issuer!r}")
    algorithms = item.get("algorithms", list(DEFAULT_ALGORITHMS))
    if not isinstance(algorithms, list) or not algorithms:
        raise fail(f"{where}.algorithms", f"must be a non-empty list of {', '.join(sorted(ASYMMETRIC_ALGORITHMS))}")
    for index, algorithm in enumerate(algorithms):
        if algorithm not in ASYMMETRIC_ALGORITHMS:
            why = ("a token must be signed" if str(algorithm).lower() == "none" else
                   "HMAC would let a public key be used as the shared secret" if str(algorithm).upper().startswith("HS")
                   else "not an asymmetric algorithm this gateway verifies")
            raise fail(f"{where}.algorithms[{index}]", f"{algorithm!r} is not allowed ({why}); use "
                                                        f"{', '.join(sorted(ASYMMETRIC_ALGORITHMS))}")
    return JwtIssuer(
        issuer=issuer,
        jwks_files=_paths(item.get("jwks_files"), f"{where}.jwks_files", fail),
        audiences=frozenset(_nonempty_strings(item.get("audiences"), f"{where}.audiences",
                                              "the audiences this gateway answers to (the token's aud)", fail)),
        algorithms=frozenset(algorithms),
    )


def _paths(value: object, where: str, fail: Fail) -> tuple[str, ...]:
    return tuple(_nonempty_strings(value, where, "paths of JWKS files (JSON with a 'keys' list)", fail))


def _nonempty_strings(value: object, where: str, what: str, fail: Fail) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v.strip() for v in value):
        raise fail(where, f"must be a non-empty list of {what}, got {value!r}")
    return value


def _positive_int(value: object, where: str, minimum: int, fail: Fail) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise fail(where, f"must be an integer >= {minimum}, got {value!r}")
    return value
