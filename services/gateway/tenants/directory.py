"""Tenants: who may call the gateway, with which priority, models and quotas.

Operators edit a YAML file (see deploy/config/tenants.example.yaml). API keys
are stored only as sha256 hex digests; print one with

    printf '%s' "$KEY" | python -m services.gateway.tenants hash-key

Neither keys nor their digests are ever logged or put in error messages (an
operator who pasted a raw key into the digest field must not see it in logs).

A tenant may also be recognised by who the caller is (tenants/identities.py): its client
certificate's SPIFFE id or DNS name, or a JWT from an issuer named in the file's `jwt` section
(tenants/jwt_policy.py, verified by tenants/jwt_verifier.py against JWKS files, tenants/jwks.py).
`TenantDirectory.recognize` is the one check that combines them (docs/security.md).

`TenantConfigWatcher` swaps in a new config when the file changes (the caller
polls) or on demand (SIGHUP); a bad file is refused and the old config stays
(services/common/file_watch.py, shared with the routing file). The JWKS files are watched
beside it (`poll_jwks`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from services.common.errors import PermissionDenied, Unauthenticated
from services.common.file_watch import ReloadResult as FileReload
from services.common.file_watch import WatchedFile
from services.common.identity import PeerIdentity
from services.common.objectives import NO_OVERRIDE, ObjectiveOverride
from services.common.priority import Priority
from services.gateway.tenants.credentials import AuthMethod, Authorization, split
from services.gateway.tenants.identities import (
    NO_IDENTITIES,
    IdentityIndex,
    TenantIdentities,
    duplicate_identity,
    parse_identities,
)
from services.gateway.tenants.jwks import JwksError, JwksFiles, JwksReload
from services.gateway.tenants.jwt_policy import NO_JWT, JwtPolicy, parse_jwt_policy
from services.gateway.tenants.jwt_verifier import JwtVerifier, looks_like_jwt

log = logging.getLogger(__name__)

ALL_MODELS = "*"
_TENANT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_BEARER = re.compile(r"^\s*bearer\s+(\S+)\s*$", re.IGNORECASE)
_BEARER_WORD = re.compile(r"\bbearer\s", re.IGNORECASE)


class TenantConfigError(ValueError):
    """The tenant file is unusable; the message names file, tenant and field."""


@dataclass(frozen=True)
class TenantQuota:
    requests_per_s: float
    requests_burst: int
    # Generate is charged prompt + max tokens up front; the unused part is refunded.
    tokens_per_s: float
    tokens_burst: int
    max_in_flight: int


@dataclass(frozen=True)
class Tenant:
    tenant_id: str
    priority: Priority
    # Relative share in the scheduler's weighted fair queueing, >= 1.
    weight: int
    # Model names, or ("*",) for every model.
    allowed_models: frozenset[str]
    quota: TenantQuota
    api_key_sha256: tuple[str, ...]
    # May call Admin/GetStatus at the gateway (infermesh status): sees every tenant's limits, never keys.
    admin: bool = False
    # Its requests' W3C trace context is followed (parent and sampling decision) when the gateway runs
    # with --trust-trace-context tenants; otherwise only linked (docs/security.md).
    trust_trace_context: bool = False
    # Certificate names and JWT claims that are this tenant too (tenants/identities.py).
    identities: TenantIdentities = NO_IDENTITIES
    # Its own TTFT / TPOT targets (objectives: {ttft_ms, tpot_ms}); unset ones are its class's.
    objectives: ObjectiveOverride = NO_OVERRIDE

    def may_use(self, model_name: str) -> bool:
        return ALL_MODELS in self.allowed_models or model_name in self.allowed_models


@dataclass(frozen=True)
class TenantConfig:
    tenants: tuple[Tenant, ...]
    source: str
    # The issuers whose tokens are accepted; NO_JWT: bearer values are API keys only.
    jwt: JwtPolicy = NO_JWT


@dataclass(frozen=True)
class Recognition:
    tenant: Tenant
    method: AuthMethod


def hash_api_key(api_key: str) -> str:
    # surrogatepass: a header byte that is not UTF-8 (aiohttp hands it on as a lone surrogate)
    # hashes like any other wrong key instead of raising; valid UTF-8 hashes as before.
    return hashlib.sha256(api_key.encode("utf-8", "surrogatepass")).hexdigest()


# --------------------------------------------------------------------------- parsing


def load_tenant_config(path: str | os.PathLike) -> TenantConfig:
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise TenantConfigError(f"{source}: cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise TenantConfigError(f"{source}: not UTF-8 text: {exc}") from None
    return parse_tenant_config(text, source)


def parse_tenant_config(text: str, source: str) -> TenantConfig:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TenantConfigError(f"{source}: not valid YAML: {_yaml_problem(exc)}") from exc
    if not isinstance(data, Mapping):
        raise TenantConfigError(f"{source}: top level must be a mapping with key 'tenants'")
    _reject_unknown(data, {"tenants", "jwt"}, f"{source}: top level")
    entries = data.get("tenants")
    if not isinstance(entries, list):
        raise TenantConfigError(f"{source}: field 'tenants': must be a list of tenants")
    jwt_policy = parse_jwt_policy(
        data.get("jwt"), lambda field_name, problem: TenantConfigError(f"{source}: field '{field_name}': {problem}"))
    tenants = tuple(_parse_tenant(entry, index, source) for index, entry in enumerate(entries))
    _reject_duplicates(tenants, source)
    _reject_unknown_issuers(tenants, jwt_policy, source)
    return TenantConfig(tenants=tenants, source=source, jwt=jwt_policy)


_TENANT_FIELDS = {"id", "api_key_sha256", "priority", "weight", "allowed_models", "quotas", "admin",
                  "trust_trace_context", "identities", "objectives"}
_OBJECTIVE_FIELDS = ("ttft_ms", "tpot_ms")
_QUOTA_FIELDS = ("requests_per_s", "requests_burst", "tokens_per_s", "tokens_burst", "max_in_flight")


def _parse_tenant(entry: object, index: int, source: str) -> Tenant:
    where = f"{source}: tenant #{index}"
    if not isinstance(entry, Mapping):
        raise TenantConfigError(f"{where}: must be a mapping")
    tenant_id = entry.get("id")
    if not isinstance(tenant_id, str) or not _TENANT_ID.match(tenant_id):
        raise TenantConfigError(
            f"{where}: field 'id': must be 1-64 characters of letters, digits, '.', '_' or '-', "
            f"starting with a letter or digit"
        )
    where = f"{source}: tenant '{tenant_id}'"
    _reject_unknown(entry, _TENANT_FIELDS, where)

    def fail(field_name: str, problem: str) -> TenantConfigError:
        return TenantConfigError(f"{where}: field '{field_name}': {problem}")

    # Fields in the order they were always checked, so a file with several faults names the same one first.
    priority = _parse_priority(entry.get("priority"), fail)
    weight = _parse_int(entry.get("weight", 1), "weight", 1, fail)
    allowed_models = _parse_models(entry.get("allowed_models"), fail)
    quota = _parse_quota(entry.get("quotas"), fail)
    identities = parse_identities(entry.get("identities"), fail)
    if "api_key_sha256" not in entry and not identities.any:
        raise fail("api_key_sha256", "is required unless 'identities' names a certificate or token identity: "
                                     "a tenant needs at least one way to be recognised")
    return Tenant(
        tenant_id=tenant_id,
        priority=priority,
        weight=weight,
        allowed_models=allowed_models,
        quota=quota,
        api_key_sha256=_parse_key_hashes(entry["api_key_sha256"], fail) if "api_key_sha256" in entry else (),
        admin=_parse_flag(entry.get("admin", False), "admin", fail),
        trust_trace_context=_parse_flag(entry.get("trust_trace_context", False), "trust_trace_context", fail),
        identities=identities,
        objectives=_parse_objectives(entry.get("objectives"), fail),
    )


def _parse_priority(value: object, fail) -> Priority:
    names = ", ".join(p.name.lower() for p in Priority)
    if not isinstance(value, str) or value.upper() not in Priority.__members__:
        raise fail("priority", f"must be one of {names}, got {value!r}")
    return Priority[value.upper()]


def _parse_models(value: object, fail) -> frozenset[str]:
    if value == ALL_MODELS:
        return frozenset({ALL_MODELS})
    if not (isinstance(value, list) and value
            and all(isinstance(m, str) and m and m != ALL_MODELS for m in value)):
        raise fail("allowed_models", f"must be '*' or a non-empty list of model names, got {value!r}")
    return frozenset(value)


def _parse_quota(value: object, fail) -> TenantQuota:
    if not isinstance(value, Mapping):
        raise fail("quotas", f"must be a mapping with {', '.join(_QUOTA_FIELDS)}")
    unknown = sorted(set(value) - set(_QUOTA_FIELDS))
    if unknown:
        raise fail(f"quotas.{unknown[0]}", f"unknown field (expected one of {', '.join(_QUOTA_FIELDS)})")
    for name in _QUOTA_FIELDS:
        if name not in value:
            raise fail(f"quotas.{name}", "is required")
    return TenantQuota(
        requests_per_s=_parse_rate(value["requests_per_s"], "quotas.requests_per_s", fail),
        requests_burst=_parse_int(value["requests_burst"], "quotas.requests_burst", 1, fail),
        tokens_per_s=_parse_rate(value["tokens_per_s"], "quotas.tokens_per_s", fail),
        tokens_burst=_parse_int(value["tokens_burst"], "quotas.tokens_burst", 1, fail),
        max_in_flight=_parse_int(value["max_in_flight"], "quotas.max_in_flight", 1, fail),
    )


def _parse_objectives(value: object, fail) -> ObjectiveOverride:
    if value is None:
        return NO_OVERRIDE
    if not isinstance(value, Mapping) or not value:
        raise fail("objectives", f"must be a mapping with {' and/or '.join(_OBJECTIVE_FIELDS)}")
    unknown = sorted(str(k) for k in set(value) - set(_OBJECTIVE_FIELDS))
    if unknown:
        raise fail(f"objectives.{unknown[0]}", f"unknown field (expected one of {', '.join(_OBJECTIVE_FIELDS)})")
    ttft_ms, tpot_ms = (None if value.get(name) is None else _parse_rate(value[name], f"objectives.{name}", fail)
                        for name in _OBJECTIVE_FIELDS)
    return ObjectiveOverride(ttft_ms=ttft_ms, tpot_ms=tpot_ms)


def _parse_key_hashes(value: object, fail) -> tuple[str, ...]:
    # Values are never echoed: a raw key pasted here by mistake must not reach the logs.
    if not isinstance(value, list) or not value:
        raise fail("api_key_sha256", "must be a non-empty list of sha256 hex digests")
    for index, item in enumerate(value):
        if not isinstance(item, str) or not _SHA256_HEX.match(item.strip().lower()):
            raise fail(
                f"api_key_sha256[{index}]",
                "must be 64 hex characters, the sha256 of the key "
                "(printf '%s' \"$KEY\" | python -m services.gateway.tenants hash-key)",
            )
    return tuple(item.strip().lower() for item in value)


def _parse_int(value: object, field_name: str, minimum: int, fail) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise fail(field_name, f"must be an integer >= {minimum}, got {value!r}")
    return value


def _parse_flag(value: object, field_name: str, fail) -> bool:
    if not isinstance(value, bool):  # a quoted "true" or 1 is refused: a flag that grants access must be plain
        raise fail(field_name, f"must be true or false, got {value!r}")
    return value


def _parse_rate(value: object, field_name: str, fail) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise fail(field_name, f"must be a number > 0, got {value!r}")
    return float(value)


def _reject_unknown(mapping: Mapping, known: set[str], where: str) -> None:
    unknown = sorted(str(k) for k in set(mapping) - known)
    if unknown:
        raise TenantConfigError(
            f"{where}: field '{unknown[0]}': unknown field (expected one of {', '.join(sorted(known))})"
        )


def _reject_duplicates(tenants: tuple[Tenant, ...], source: str) -> None:
    owner_by_hash: dict[str, str] = {}
    seen_ids: set[str] = set()
    for tenant in tenants:
        if tenant.tenant_id in seen_ids:
            raise TenantConfigError(f"{source}: tenant '{tenant.tenant_id}': field 'id': duplicate tenant id")
        seen_ids.add(tenant.tenant_id)
        for index, digest in enumerate(tenant.api_key_sha256):
            if digest in owner_by_hash:
                raise TenantConfigError(
                    f"{source}: tenant '{tenant.tenant_id}': field 'api_key_sha256[{index}]': "
                    f"same key as tenant '{owner_by_hash[digest]}'"
                )
            owner_by_hash[digest] = tenant.tenant_id
    shared = duplicate_identity((t.tenant_id, t.identities) for t in tenants)
    if shared is not None:
        tenant_id, rule, other = shared
        raise TenantConfigError(f"{source}: tenant '{tenant_id}': field 'identities': {rule} is also "
                                f"tenant '{other}''s")


def _reject_unknown_issuers(tenants: tuple[Tenant, ...], policy: JwtPolicy, source: str) -> None:
    for tenant in tenants:
        for issuer in sorted(tenant.identities.issuers):
            if policy.issuer(issuer) is None:
                raise TenantConfigError(
                    f"{source}: tenant '{tenant.tenant_id}': field 'identities.jwt': issuer {issuer!r} is not "
                    "in the file's jwt.issuers (tokens are checked only against issuers declared there)")


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or type(exc).__name__
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else str(problem)


# --------------------------------------------------------------------------- lookup


class TenantDirectory:
    """Recognises callers (API key, client certificate, JWT) and answers model permissions for one config."""

    def __init__(self, config: TenantConfig, jwks: JwksFiles | None = None) -> None:
        """jwks: the config's JWKS files, read; None reads them here (raises JwksError)."""
        self.config = config
        self._tenant_by_hash = {digest: t for t in config.tenants for digest in t.api_key_sha256}
        self._tenant_by_id = {t.tenant_id: t for t in config.tenants}
        self._identities = IdentityIndex((t.tenant_id, t.identities) for t in config.tenants)
        self.jwks = jwks if jwks is not None else JwksFiles(config.jwt.jwks_files)
        self._verifier = JwtVerifier(config.jwt, self.jwks) if config.jwt.issuers else None

    def authenticate(self, authorization: Authorization) -> Tenant:
        """The tenant of a caller: `recognize` without the method."""
        return self.recognize(authorization).tenant

    def recognize(self, authorization: Authorization) -> Recognition:
        """The tenant for an `authorization: Bearer <key or JWT>` value and/or a verified client certificate.

        A certificate that names a tenant is enough on its own. With a bearer value too, both must
        name the same tenant (PermissionDenied naming both otherwise); a certificate that names no
        tenant leaves the choice to the bearer value, so a caller can present its certificate
        before the tenants file knows it."""
        value, peer = split(authorization)
        by_certificate = self._tenant_for_certificate(peer)
        if not value:
            if by_certificate is not None:
                return Recognition(by_certificate, AuthMethod.MTLS)
            if peer is not None:
                raise Unauthenticated(f"the client certificate ({peer}) matches no tenant, and no "
                                      "'authorization: Bearer <key or token>' was sent")
            raise Unauthenticated("missing API key: send metadata 'authorization: Bearer <key>'")
        bearer = self._bearer(value)
        by_bearer = self._tenant_for_bearer(bearer)
        if by_certificate is None:
            return by_bearer
        if by_certificate.tenant_id != by_bearer.tenant.tenant_id:
            what = "token" if by_bearer.method is AuthMethod.JWT else "API key"
            raise PermissionDenied(f"the client certificate ({peer}) is tenant '{by_certificate.tenant_id}' but the "
                                   f"{what} is tenant '{by_bearer.tenant.tenant_id}': send credentials of one tenant")
        both = AuthMethod.MTLS_JWT if by_bearer.method is AuthMethod.JWT else AuthMethod.MTLS_KEY
        return Recognition(by_certificate, both)

    @staticmethod
    def _bearer(authorization: str) -> str:
        match = _BEARER.match(authorization)
        if match is None:
            if len(_BEARER_WORD.findall(authorization)) > 1:
                raise Unauthenticated("more than one authorization value: send one 'Bearer <key>'")
            raise Unauthenticated("malformed authorization metadata: expected 'Bearer <key>'")
        return match.group(1)

    def _tenant_for_certificate(self, peer: PeerIdentity | None) -> Tenant | None:
        if peer is None or not self._identities.matches_certificates:
            return None
        tenant_id = self._identities.tenant_for_certificate(peer.names)
        return None if tenant_id is None else self._tenant_by_id[tenant_id]

    def _tenant_for_bearer(self, bearer: str) -> Recognition:
        # An API key first: one hash and one lookup, and a key that happens to look like a JWT still works.
        tenant = self._tenant_by_hash.get(hash_api_key(bearer))
        if tenant is not None or not looks_like_jwt(bearer):
            return Recognition(self.authenticate_key(bearer), AuthMethod.KEY)
        if self._verifier is None:
            raise Unauthenticated("invalid API key (a JWT was sent, but the tenants file trusts no token issuer)")
        token = self._verifier.verify(bearer)
        tenant_id = self._identities.tenant_for_claims(token.issuer, token.claims)
        if tenant_id is None:
            raise Unauthenticated(f"the token of issuer {token.issuer!r} is valid but matches no tenant "
                                  "(by subject or claim)")
        return Recognition(self._tenant_by_id[tenant_id], AuthMethod.JWT)

    def authenticate_key(self, api_key: str) -> Tenant:
        digest = hash_api_key(api_key)
        # The dict lookup is keyed by the digest of the caller's own guess (SipHash-randomised
        # buckets), so its timing reveals nothing about stored digests; compare_digest keeps the
        # final equality check constant-time too.
        tenant = self._tenant_by_hash.get(digest)
        if tenant is None or not any(hmac.compare_digest(digest, d) for d in tenant.api_key_sha256):
            raise Unauthenticated("invalid API key")
        return tenant

    def check_model_allowed(self, tenant: Tenant, model_name: str) -> None:
        if not tenant.may_use(model_name):
            raise PermissionDenied(f"tenant '{tenant.tenant_id}' may not use model '{model_name}'")

    def tenant(self, tenant_id: str) -> Tenant | None:
        return self._tenant_by_id.get(tenant_id)

    @property
    def tenants(self) -> tuple[Tenant, ...]:
        return self.config.tenants


# --------------------------------------------------------------------------- reloading


@dataclass(frozen=True)
class ReloadResult:
    applied: bool
    # Why it was refused, or a summary of what was applied.
    reason: str
    num_tenants: int


def _load_directory(path: str | os.PathLike) -> TenantDirectory:
    config = load_tenant_config(path)
    try:
        return TenantDirectory(config)
    except JwksError as exc:
        raise TenantConfigError(f"{config.source}: field 'jwt': {exc}") from None


class TenantConfigWatcher:
    """Holds the current `TenantDirectory` and replaces it when the file changes (services/common/file_watch.py).

    `poll()` is cheap (one stat) and meant to be called every second or so;
    `reload()` is for SIGHUP. The first load happens in the constructor and
    raises `TenantConfigError`, so a gateway never starts on a bad file.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        on_reload: Callable[[TenantConfig], None] | None = None,
        stat: Callable[[str | os.PathLike], os.stat_result] = os.stat,
    ) -> None:
        self.path = path
        self.file = WatchedFile(
            path, _load_directory, what="tenant config", error=TenantConfigError,
            describe=lambda directory: f"{len(directory.tenants)} tenants",
            on_reload=None if on_reload is None else (lambda directory: on_reload(directory.config)),
            log=log, stat=stat,
        )

    @property
    def directory(self) -> TenantDirectory:
        return self.file.current

    def poll(self) -> ReloadResult | None:
        """Reload if the file's mtime, size or inode changed; None when unchanged."""
        result = self.file.poll()
        return None if result is None else self._with_count(result)

    def reload(self) -> ReloadResult:
        return self._with_count(self.file.reload())

    def poll_jwks(self) -> JwksReload | None:
        """Re-read the JWKS files the config in force names if their bytes changed; None when unchanged."""
        return self.directory.jwks.poll()

    def _with_count(self, result: FileReload) -> ReloadResult:
        return ReloadResult(result.applied, result.reason, len(self.directory.tenants))


# --------------------------------------------------------------------------- CLI


def main(argv: list[str]) -> int:
    if argv != ["hash-key"]:
        print(
            "usage: python -m services.gateway.tenants hash-key  (reads the key from stdin)\n"
            "       python -m services.gateway.tenants fetch-jwks --issuer URL --out FILE [--every-s N]",
            file=sys.stderr,
        )
        return 2
    api_key = sys.stdin.read().strip()
    if not api_key:
        print("error: no key on stdin", file=sys.stderr)
        return 1
    print(hash_api_key(api_key))
    return 0

