"""Where the load goes: a target URL parsed into its kind, address and transport security.

    HOST:PORT, grpc://HOST:PORT          infermesh.v1.Inference (TLS when a CA file is given, as before)
    openai+http(s)://HOST:PORT[/v1]      OpenAI completions / chat completions
    kserve+grpc://HOST:PORT              KServe v2 / Triton GRPCInferenceService (TLS with a CA file)
    kserve+http(s)://HOST:PORT           KServe v2 REST
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from urllib.parse import urlsplit


class TargetKind(Enum):
    INFERMESH_GRPC = "grpc"
    OPENAI_HTTP = "openai+http"
    KSERVE_GRPC = "kserve+grpc"
    KSERVE_HTTP = "kserve+http"


_SCHEMES = {
    "grpc": (TargetKind.INFERMESH_GRPC, False),
    "openai+http": (TargetKind.OPENAI_HTTP, False),
    "openai+https": (TargetKind.OPENAI_HTTP, True),
    "kserve+grpc": (TargetKind.KSERVE_GRPC, False),
    "kserve+http": (TargetKind.KSERVE_HTTP, False),
    "kserve+https": (TargetKind.KSERVE_HTTP, True),
}


@dataclass(frozen=True)
class TargetAddress:
    kind: TargetKind
    host_port: str  # "127.0.0.1:8000"
    # HTTP kinds: https. gRPC kinds follow the CA file (given: TLS), so this stays False for them.
    https: bool
    base_path: str  # HTTP only: the path the API lives under, without a trailing slash ("/v1"; "" for KServe)
    url: str  # as given, for the report

    @property
    def base_url(self) -> str:
        """HTTP kinds: scheme://host:port/base_path."""
        return f"{'https' if self.https else 'http'}://{self.host_port}{self.base_path}"


def parse_target(url: str) -> TargetAddress:
    """Raises ValueError naming what is wrong with `url`."""
    text = url.strip()
    if not text:
        raise ValueError("target: empty; give HOST:PORT or a URL such as openai+http://127.0.0.1:8000/v1")
    if "://" not in text:
        return TargetAddress(TargetKind.INFERMESH_GRPC, _host_port(text, url), False, "", url)
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(f"target {url!r}: unknown scheme {parts.scheme!r}; use one of {', '.join(_SCHEMES)}")
    if parts.query or parts.fragment:
        raise ValueError(f"target {url!r}: a query or fragment has no meaning here")
    kind, https = _SCHEMES[scheme]
    host_port = _host_port(parts.netloc, url)
    path = parts.path.rstrip("/")
    if kind is TargetKind.OPENAI_HTTP:
        return TargetAddress(kind, host_port, https, path or "/v1", url)
    if kind is TargetKind.KSERVE_HTTP:
        return TargetAddress(kind, host_port, https, path, url)
    if path:
        raise ValueError(f"target {url!r}: a gRPC target takes no path, got {parts.path!r}")
    return TargetAddress(kind, host_port, False, "", url)


def _host_port(netloc: str, url: str) -> str:
    if "@" in netloc:
        raise ValueError(f"target {url!r}: credentials do not go in the URL; give them as a tenant's api_key")
    host, sep, port = netloc.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"target {url!r}: expected HOST:PORT with a port in 1..65535, got {netloc!r}")
    return netloc
