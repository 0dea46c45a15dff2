"""What a caller presented, and how the gateway recognised its tenant.

The fronts (fronts/caller.py) hand the tenants' check either the authorization value alone (a
plain string, as before client certificates existed) or `Credentials`, which adds the names of
the verified client certificate the connection came with. Everything between the front and the
check passes the value along untouched (`Authorization`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from services.common.identity import PeerIdentity


class AuthMethod(enum.Enum):
    """How a tenant was recognised: a label value in metrics and logs (bounded: these five)."""

    KEY = "key"
    JWT = "jwt"
    MTLS = "mtls"
    # A certificate and a bearer credential naming the same tenant (a service switching to its certificate).
    MTLS_KEY = "mtls+key"
    MTLS_JWT = "mtls+jwt"
    # Development mode: no tenants file, every caller is 'anonymous'.
    ANONYMOUS = "anonymous"
    # Nothing presented (a refusal's label).
    NONE = "none"


@dataclass(frozen=True)
class Credentials:
    authorization: str | None
    # The verified client certificate's names (SPIFFE id, URIs, DNS names); None: no certificate.
    peer: PeerIdentity | None = None


# What a front hands the tenants' check: the authorization value, or Credentials with a certificate.
Authorization = str | Credentials | None


def split(authorization: Authorization) -> tuple[str | None, PeerIdentity | None]:
    if isinstance(authorization, Credentials):
        return authorization.authorization, authorization.peer
    return authorization, None


def presented(authorization: Authorization) -> AuthMethod:
    """What the caller tried to be recognised by, without checking it (the label of a refusal)."""
    value, peer = split(authorization)
    if value:
        # A JWT's shape ("eyJ...x.y"), as jwt_verifier.looks_like_jwt; anything else is taken for a key.
        bearer = "jwt" if "eyJ" in value and value.count(".") == 2 else "key"
        return AuthMethod(f"mtls+{bearer}" if peer is not None else bearer)
    return AuthMethod.MTLS if peer is not None else AuthMethod.NONE
