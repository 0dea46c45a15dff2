"""Tenants recognised by who the caller is, not by a shared key: certificate names and JWT claims.

A tenant's `identities` in the tenants file:

    identities:
      spiffe_ids: ["spiffe://prod.example/ns/search/sa/api"]     # exactly this workload
      spiffe_id_prefixes: ["spiffe://prod.example/ns/search/"]   # any workload under this path
      dns_names: ["search.internal.example"]                     # a DNS SAN, exactly
      jwt:
        - {issuer: "https://idp.example", subject: "svc-search"}       # iss + sub
        - {issuer: "https://idp.example", claim: team, value: search}  # iss + one claim's value

`IdentityIndex` answers which tenant a verified certificate or a verified token's claims name.
Most specific wins and ties between tenants are refused rather than guessed: for a certificate an
exact SPIFFE id, then the longest SPIFFE prefix, then a DNS name; for a token its issuer and
subject, then its claims. Two tenants at the same rank is PermissionDenied naming both: an
identity that could be either must never silently become one of them.

The TLS handshake verified the certificate and jwt_verifier.py the token before anything here
runs: this module only maps names that are already proven.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from services.common.errors import PermissionDenied

# SPIFFE ids (spiffe.io, SPIFFE-ID spec): a lowercase trust domain, then path segments of
# letters, digits, '.', '-' and '_'; no empty, '.' or '..' segment; no query, fragment or port.
_TRUST_DOMAIN = r"[a-z0-9._-]+"
_SEGMENT = r"(?!\.\.?(?:/|$))[A-Za-z0-9._-]+"
_SPIFFE_ID = re.compile(rf"^spiffe://{_TRUST_DOMAIN}(?:/{_SEGMENT})+$")
_SPIFFE_PREFIX = re.compile(rf"^spiffe://{_TRUST_DOMAIN}/(?:{_SEGMENT}/)*$")
_DNS_NAME = re.compile(r"^(?=.{1,253}$)(?:[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
SPIFFE_SCHEME = "spiffe://"
# Claims a tenant may be matched by: plain strings (or a list of them, as `groups` often is).
_CLAIM_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]{0,63}$")
# Matching by these would defeat the other checks: iss and sub have their own rule, the rest are times or audience.
_RESERVED_CLAIMS = frozenset({"iss", "sub", "aud", "exp", "nbf", "iat", "jti"})


@dataclass(frozen=True)
class JwtSubject:
    issuer: str
    subject: str


@dataclass(frozen=True)
class JwtClaim:
    issuer: str
    claim: str
    value: str


@dataclass(frozen=True)
class TenantIdentities:
    """How a tenant is recognised besides (or instead of) its API keys; empty: by key only."""

    spiffe_ids: tuple[str, ...] = ()
    # Each ends with '/', so "spiffe://td/ns/a/" never matches "spiffe://td/ns/ab/x".
    spiffe_id_prefixes: tuple[str, ...] = ()
    dns_names: tuple[str, ...] = ()
    jwt_subjects: tuple[JwtSubject, ...] = ()
    jwt_claims: tuple[JwtClaim, ...] = ()

    @property
    def any(self) -> bool:
        return bool(self.spiffe_ids or self.spiffe_id_prefixes or self.dns_names or self.jwt_subjects
                    or self.jwt_claims)

    @property
    def issuers(self) -> frozenset[str]:
        return frozenset(s.issuer for s in self.jwt_subjects) | frozenset(c.issuer for c in self.jwt_claims)


NO_IDENTITIES = TenantIdentities()
Fail = Callable[[str, str], Exception]


# --------------------------------------------------------------------------- parsing


_FIELDS = ("spiffe_ids", "spiffe_id_prefixes", "dns_names", "jwt")


def parse_identities(value: object, fail: Fail) -> TenantIdentities:
    """A tenant's `identities` mapping; `fail(field, problem)` makes the error naming file and tenant."""
    if value is None:
        return NO_IDENTITIES
    if not isinstance(value, Mapping) or not value:
        raise fail("identities", f"must be a mapping with one or more of {', '.join(_FIELDS)}")
    unknown = sorted(str(k) for k in value if k not in _FIELDS)
    if unknown:
        raise fail(f"identities.{unknown[0]}", f"unknown field (expected one of {', '.join(_FIELDS)})")
    jwt_rules = _parse_jwt_rules(value.get("jwt", []), fail)
    identities = TenantIdentities(
        spiffe_ids=_strings(value.get("spiffe_ids", []), "identities.spiffe_ids", _check_spiffe_id, fail),
        spiffe_id_prefixes=_strings(value.get("spiffe_id_prefixes", []), "identities.spiffe_id_prefixes",
                                    _check_spiffe_prefix, fail),
        dns_names=_strings(value.get("dns_names", []), "identities.dns_names", _check_dns_name, fail),
        jwt_subjects=tuple(r for r in jwt_rules if isinstance(r, JwtSubject)),
        jwt_claims=tuple(r for r in jwt_rules if isinstance(r, JwtClaim)),
    )
    if not identities.any:
        raise fail("identities", "names no identity (every list is empty)")
    return identities


def _strings(value: object, field_name: str, check: Callable[[str], str | None], fail: Fail) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise fail(field_name, f"must be a list, got {type(value).__name__}")
    out: list[str] = []
    for index, item in enumerate(value):
        problem = check(item) if isinstance(item, str) else f"must be a string, got {item!r}"
        if problem:
            raise fail(f"{field_name}[{index}]", problem)
        if item in out:
            raise fail(f"{field_name}[{index}]", f"{item!r} is listed twice")
        out.append(item)
    return tuple(out)


def _check_spiffe_id(text: str) -> str | None:
    if _SPIFFE_ID.match(text):
        return None
    hint = " (a prefix ending in '/' goes in spiffe_id_prefixes)" if text.endswith("/") else ""
    return (f"must be a SPIFFE id 'spiffe://<trust domain>/<path>' with a lowercase trust domain and "
            f"segments of letters, digits, '.', '-', '_'{hint}, got {text!r}")


def _check_spiffe_prefix(text: str) -> str | None:
    if _SPIFFE_PREFIX.match(text):
        return None
    return ("must be 'spiffe://<trust domain>/' followed by whole path segments, ending in '/' "
            f"(a prefix never cuts a segment or crosses a trust domain), got {text!r}")


def _check_dns_name(text: str) -> str | None:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        pass
    else:  # an IP SAN is not a name: gRPC hands IP SANs over beside DNS names, so one must never match
        return f"must be a DNS name, not an IP address, got {text!r}"
    if _DNS_NAME.match(text):
        return None
    return f"must be a lowercase DNS name without wildcards, got {text!r}"


def _parse_jwt_rules(value: object, fail: Fail) -> list[JwtSubject | JwtClaim]:
    if not isinstance(value, list):
        raise fail("identities.jwt", "must be a list of {issuer, subject} or {issuer, claim, value}")
    rules: list[JwtSubject | JwtClaim] = []
    for index, item in enumerate(value):
        where = f"identities.jwt[{index}]"
        if not isinstance(item, Mapping):
            raise fail(where, "must be a mapping {issuer, subject} or {issuer, claim, value}")
        keys = set(item)
        if keys == {"issuer", "subject"}:
            rule: JwtSubject | JwtClaim = JwtSubject(_text(item, "issuer", where, fail),
                                                     _text(item, "subject", where, fail))
        elif keys == {"issuer", "claim", "value"}:
            claim = _text(item, "claim", where, fail)
            if not _CLAIM_NAME.match(claim):
                raise fail(f"{where}.claim", f"must be a claim name (letters, digits, '_', '.', ':', '-'), got {claim!r}")
            if claim in _RESERVED_CLAIMS:
                raise fail(f"{where}.claim", f"'{claim}' cannot pick a tenant (use subject for 'sub'; the "
                                             "others are checked, not matched)")
            rule = JwtClaim(_text(item, "issuer", where, fail), claim, _text(item, "value", where, fail))
        else:
            raise fail(where, f"must have exactly issuer and subject, or issuer, claim and value; got "
                              f"{', '.join(sorted(map(str, keys))) or 'nothing'}")
        if rule in rules:
            raise fail(where, "is listed twice")
        rules.append(rule)
    return rules


def _text(item: Mapping, key: str, where: str, fail: Fail) -> str:
    value = item[key]
    if not isinstance(value, str) or not value.strip() or len(value) > 1024:
        raise fail(f"{where}.{key}", f"must be a non-empty string of at most 1024 characters, got {value!r}")
    return value


# --------------------------------------------------------------------------- index


def duplicate_identity(tenants: Iterable[tuple[str, TenantIdentities]]) -> tuple[str, str, str] | None:
    """(tenant id, the rule, the other tenant's id) for the first identity two tenants share; None if none."""
    seen: dict[object, str] = {}
    for tenant_id, identities in tenants:
        rules: list[tuple[object, str]] = [
            *((("spiffe", s), f"spiffe_ids {s!r}") for s in identities.spiffe_ids),
            *((("prefix", p), f"spiffe_id_prefixes {p!r}") for p in identities.spiffe_id_prefixes),
            *((("dns", d), f"dns_names {d!r}") for d in identities.dns_names),
            *((s, f"jwt issuer {s.issuer!r} subject {s.subject!r}") for s in identities.jwt_subjects),
            *((c, f"jwt issuer {c.issuer!r} claim {c.claim}={c.value!r}") for c in identities.jwt_claims),
        ]
        for key, described in rules:
            if key in seen:
                return tenant_id, described, seen[key]
            seen[key] = tenant_id
    return None


class IdentityIndex:
    """Which tenant id a certificate's names or a token's claims name, by the rules above."""

    def __init__(self, tenants: Iterable[tuple[str, TenantIdentities]]) -> None:
        self._by_spiffe: dict[str, str] = {}
        self._prefixes: list[tuple[str, str]] = []
        self._by_dns: dict[str, str] = {}
        self._by_subject: dict[tuple[str, str], str] = {}
        self._claims_by_issuer: dict[str, list[JwtClaim]] = {}
        self._claim_owner: dict[JwtClaim, str] = {}
        for tenant_id, identities in tenants:
            self._by_spiffe.update(dict.fromkeys(identities.spiffe_ids, tenant_id))
            self._prefixes += [(p, tenant_id) for p in identities.spiffe_id_prefixes]
            self._by_dns.update(dict.fromkeys(identities.dns_names, tenant_id))
            self._by_subject.update({(s.issuer, s.subject): tenant_id for s in identities.jwt_subjects})
            for claim in identities.jwt_claims:
                self._claims_by_issuer.setdefault(claim.issuer, []).append(claim)
                self._claim_owner[claim] = tenant_id
        # Longest first: the first prefix that matches is the most specific one.
        self._prefixes.sort(key=lambda rule: len(rule[0]), reverse=True)

    @property
    def matches_certificates(self) -> bool:
        return bool(self._by_spiffe or self._prefixes or self._by_dns)

    def tenant_for_certificate(self, names: Iterable[str]) -> str | None:
        """The tenant a verified certificate's SAN names point to; None when no rule matches."""
        names = tuple(names)
        spiffe = [n for n in names if n.startswith(SPIFFE_SCHEME)]
        dns = [n.lower() for n in names if "://" not in n]
        for rank in (
            {self._by_spiffe[n] for n in spiffe if n in self._by_spiffe},
            {self._longest_prefix(n) for n in spiffe} - {None},
            {self._by_dns[n] for n in dns if n in self._by_dns},
        ):
            chosen = _one(rank, "the client certificate's names")
            if chosen is not None:
                return chosen
        return None

    def _longest_prefix(self, spiffe_id: str) -> str | None:
        for prefix, tenant_id in self._prefixes:
            if spiffe_id.startswith(prefix):
                return tenant_id
        return None

    def tenant_for_claims(self, issuer: str, claims: Mapping[str, object]) -> str | None:
        """The tenant a verified token's issuer and claims point to; None when no rule matches."""
        subject = claims.get("sub")
        if isinstance(subject, str):
            tenant_id = self._by_subject.get((issuer, subject))
            if tenant_id is not None:
                return tenant_id
        matched = {self._claim_owner[rule] for rule in self._claims_by_issuer.get(issuer, ())
                   if _claim_has(claims.get(rule.claim), rule.value)}
        return _one(matched, "the token's claims")


def _claim_has(value: object, wanted: str) -> bool:
    if isinstance(value, str):
        return value == wanted
    return isinstance(value, list) and wanted in value


def _one(tenant_ids: set, what: str) -> str | None:
    if len(tenant_ids) > 1:
        first, second = sorted(tenant_ids)[:2]
        raise PermissionDenied(f"{what} match tenants '{first}' and '{second}' equally: the tenants file must "
                               "name each identity for one tenant only")
    return next(iter(tenant_ids), None)
