"""atheris: the gateway's routing file (services/gateway/routing/table.py: load_routing_file), bytes as on disk."""

from __future__ import annotations

import atheris

from fuzz.harness import ScratchFile, fuzz

with atheris.instrument_imports(include=["services.gateway.routing.table", "yaml"]):
    from services.gateway.routing.table import RoutingConfigError, load_routing_file

_FILE = ScratchFile("routing.yaml")


def check(data: bytes) -> None:
    try:
        load_routing_file(_FILE.write(data))
    except RoutingConfigError:
        pass


if __name__ == "__main__":
    fuzz(check)
