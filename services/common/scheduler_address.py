"""`--scheduler-address`, as the gateway and the worker both read it: one parser.

    10.0.0.5:50052,10.0.0.6:50052     a fixed list (IPv6 literals as [::1]:50052)
    dns:///schedulers.mesh.svc:50052  every A/AAAA record of the name (a Kubernetes headless Service)

The gateway routes to every endpoint (services/gateway/routing/discovery.py); a classifier worker
attaches to every endpoint (services/worker/attach_every.py), a generator worker to one at a time
(services/worker/scheduler_endpoints.py). Both re-resolve a DNS name themselves.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

DNS_SCHEME = "dns:///"
_EXPECTED = "expected host:port[,host:port...] or dns:///name:port"


class SchedulerAddressError(ValueError):
    """The scheduler address is unusable; the message quotes it and says what form is expected."""


@dataclass(frozen=True)
class SchedulerAddress:
    """What --scheduler-address names: a fixed endpoint list, or a DNS name and port."""

    # host:port endpoints of a fixed list, as gRPC dials them (IPv6 in brackets); empty for a DNS name.
    endpoints: tuple[str, ...] = ()
    # The DNS name whose records are the endpoints; "" for a fixed list.
    dns_name: str = ""
    # The DNS name's port; 0 for a fixed list.
    port: int = 0

    @property
    def is_dns(self) -> bool:
        return bool(self.dns_name)

    @property
    def is_single(self) -> bool:
        """One fixed endpoint: nothing to choose among."""
        return not self.is_dns and len(self.endpoints) == 1


def parse_scheduler_address(text: str) -> SchedulerAddress:
    """Parses `host:port[,host:port...]` or `dns:///name:port`; raises SchedulerAddressError."""
    text = text.strip()
    if text.startswith(DNS_SCHEME):
        host, port = _split_host_port(text[len(DNS_SCHEME):], text)
        return SchedulerAddress(dns_name=host, port=port)
    if "://" in text:
        raise SchedulerAddressError(
            f"scheduler address {text!r}: unknown scheme, only the dns:/// scheme is supported ({_EXPECTED})")
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise SchedulerAddressError(f"scheduler address {text!r} has an empty entry ({_EXPECTED})")
    endpoints = [format_endpoint(*_split_host_port(item, text)) for item in items]
    if len(set(endpoints)) != len(endpoints):
        raise SchedulerAddressError(f"scheduler address {text!r}: lists an endpoint twice")
    return SchedulerAddress(endpoints=tuple(endpoints))


def _split_host_port(item: str, whole: str) -> tuple[str, int]:
    host, sep, port_text = item.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # [::1]:50052
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise SchedulerAddressError(
            f"scheduler address {whole!r}: {item!r} is not host:port with a port in 1..65535 ({_EXPECTED})")
    return host, int(port_text)


def format_endpoint(host: str, port: int) -> str:
    """host:port as gRPC dials it: IPv6 literals in brackets."""
    try:
        is_v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        is_v6 = False
    return f"[{host}]:{port}" if is_v6 else f"{host}:{port}"
