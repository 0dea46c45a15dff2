"""Where the quota store is: `host:port` (one Valkey/Redis), or `sentinel://host:port[,host:port...]/name`
(Valkey Sentinel: the sentinels are asked for the current primary of `name` at every (re)connect, so a
failover to a replica is followed without a restart). Pure parsing; store.py opens the connection."""

from __future__ import annotations

from dataclasses import dataclass

SENTINEL_SCHEME = "sentinel://"


@dataclass(frozen=True)
class StoreAddress:
    # One store: (host, port); None with sentinels.
    direct: tuple[str, int] | None
    sentinels: tuple[tuple[str, int], ...] = ()
    # The primary's name in the sentinels' configuration (`sentinel monitor NAME ...`).
    primary_name: str = ""


def parse_store_address(text: str) -> StoreAddress:
    """Raises ValueError naming what is wrong."""
    if not text.startswith(SENTINEL_SCHEME):
        return StoreAddress(direct=_host_port(text))
    hosts, slash, name = text[len(SENTINEL_SCHEME):].partition("/")
    if not slash or not name or "/" in name:
        raise ValueError(f"quota_store_address with sentinels must be sentinel://host:port[,host:port...]/name, got {text!r}")
    return StoreAddress(direct=None, sentinels=tuple(_host_port(h) for h in hosts.split(",")), primary_name=name)


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.strip().rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"quota_store_address must be host:port, got {text!r}")
    return host.strip("[]"), int(port)
