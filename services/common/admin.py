"""What an Admin/GetStatus reply holds, as plain data, and who may ask for it without a certificate.

No grpc here: each service's `admin_status.py` assembles a `StatusReport` from its live
objects, `admin_servicer.py` converts it to infermesh.v1.ServiceStatus, and the CLI turns
the reply back into a `StatusReport` to render it as a table or as JSON.

Access without a verified client certificate (plaintext, TLS without client auth, or the
gateway's anonymous mode) is granted only to callers on the loopback interface: an operator
on the host (or `kubectl port-forward`, which connects from the pod's loopback) can look,
nobody else can. With mTLS the identity policy decides instead (identity.py, Role.OPERATOR).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import unquote

from services.common.errors import PermissionDenied

Cell = str | int | float | bool


@dataclass(frozen=True)
class Section:
    """A named table; every row has one cell per column."""

    name: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Cell, ...], ...] = ()

    def __post_init__(self) -> None:
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(f"section {self.name}: a row has {len(row)} cells for {len(self.columns)} columns")

    def records(self) -> list[dict[str, Cell]]:
        return [dict(zip(self.columns, row, strict=True)) for row in self.rows]


@dataclass(frozen=True)
class StatusReport:
    service: str  # gateway | scheduler | worker
    version: str
    uptime_s: float
    facts: tuple[tuple[str, Cell], ...] = ()
    sections: tuple[Section, ...] = ()

    def to_dict(self) -> dict:
        """The JSON shape `infermesh status --json` prints: facts as an object, sections as lists of records."""
        return {
            "service": self.service,
            "version": self.version,
            "uptime_s": round(self.uptime_s, 3),
            **dict(self.facts),
            **{section.name: section.records() for section in self.sections},
        }

    def section(self, name: str) -> Section | None:
        return next((s for s in self.sections if s.name == name), None)


@dataclass(frozen=True)
class RolloutOutcome:
    """A rollout after Admin/ControlRollout acted on it (the gateway's)."""

    model: str
    canary_version: str
    state: str  # running | paused | rolled_back | promoted | aborted
    step: str  # "10% (2/4)"
    canary_percent: float
    decision: str  # as logged; "" when the rollout was already where the action leads


# peer ("ipv4:127.0.0.1:5000"), invocation metadata, whether the caller presented a verified certificate;
# raises Unauthenticated or PermissionDenied.
Authorize = Callable[[str, Sequence[tuple[str, str | bytes]], bool], None]
Report = Callable[[], StatusReport]
# model, action (pause | resume | abort | promote), who asked (for the decision's evidence);
# raises the domain errors Admin/ControlRollout documents.
ControlRollout = Callable[[str, str, str], RolloutOutcome]


def section(name: str, columns: Iterable[str], rows: Iterable[Iterable[Cell]]) -> Section:
    return Section(name, tuple(columns), tuple(tuple(row) for row in rows))


def facts(values: Mapping[str, Cell]) -> tuple[tuple[str, Cell], ...]:
    return tuple(values.items())


def joined(items: Iterable[str]) -> str:
    """A list in one cell ("" when empty): tables stay flat, JSON stays a record per row."""
    return ",".join(sorted(items))


def tls_mode(settings, client_certs_by_default: bool) -> str:
    """off | server TLS | mTLS, as a service's ServerSettings resolve (tls.plan's rule, without grpc)."""
    if not settings.tls_cert_file:
        return "off"
    auth = settings.tls_client_auth
    require = auth == "require" or (auth == "auto" and client_certs_by_default)
    if not require:
        return "server TLS"
    return "mTLS" + ("" if settings.tls_identity_check else " (no per-method identity check)")


# --------------------------------------------------------------------------- access


def peer_host(peer: str) -> str:
    """The host part of a gRPC peer string ("ipv4:127.0.0.1:5000", "ipv6:%5B::1%5D:5000", "unix:...")."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return unquote(rest).rpartition(":")[0].strip("[]")
    return kind


def is_loopback(peer: str) -> bool:
    """Whether a gRPC peer string names a caller on this host's loopback interface (unix sockets too)."""
    if peer.startswith("unix:"):
        return True
    try:
        return ipaddress.ip_address(peer_host(peer)).is_loopback
    except ValueError:
        return False


def check_loopback(peer: str, why: str) -> None:
    """Raise PermissionDenied unless the caller is on loopback; `why` says what would let it in instead."""
    if not is_loopback(peer):
        raise PermissionDenied(f"Admin/GetStatus from {peer_host(peer)} refused: {why}; "
                               "without it only callers on this host's loopback interface are answered")


def certificate_or_loopback(peer: str, metadata, has_cert: bool) -> None:
    """The scheduler's and workers' rule: a verified certificate got here through the identity policy
    (identity.py: only an operator id may call Admin/GetStatus); without one, loopback only."""
    if not has_cert:
        check_loopback(peer, "no verified client certificate (mTLS with an operator identity, "
                             "--tls-allowed-admin-ids)")
