"""atheris: the gateway's tenants file (services/gateway/tenants/directory.py: load_tenant_config), bytes as on disk."""

from __future__ import annotations

import atheris

from fuzz.harness import ScratchFile, fuzz

with atheris.instrument_imports(include=["services.gateway.tenants.directory", "yaml"]):
    from services.gateway.tenants.directory import TenantConfigError, load_tenant_config

_FILE = ScratchFile("tenants.yaml")


def check(data: bytes) -> None:
    try:
        load_tenant_config(_FILE.write(data))
    except TenantConfigError:
        pass


if __name__ == "__main__":
    fuzz(check)
