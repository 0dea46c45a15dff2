"""atheris: the shared quota store's sync reply as the gateway parses it
(services/gateway/quota_store.py: _parse_reply of the Lua script's [live, bad keys, JSON grants])."""

from __future__ import annotations

import atheris

from fuzz.harness import fuzz

with atheris.instrument_imports(include=["services.gateway.quota_store"]):
    from services.gateway.quota_lease import LeasePlan, TenantAsk
    from services.gateway.quota_store import StoreReplyError, _parse_reply
    from services.gateway.tenants import TenantQuota


def _ask(index: int) -> TenantAsk:
    quota = TenantQuota(requests_per_s=10, requests_burst=20, tokens_per_s=100, tokens_burst=200, max_in_flight=4)
    return TenantAsk(f"t{index}", quota, 0.0, 0.0, 5.0, 50.0, 1, 2)


def _value(provider: atheris.FuzzedDataProvider) -> object:
    """One element of a RESP reply as valkey-py hands it over: int, bytes, str, None, a list."""
    kind = provider.ConsumeIntInRange(0, 4)
    if kind == 0:
        return provider.ConsumeInt(8)
    if kind == 1:
        return provider.ConsumeBytes(provider.ConsumeIntInRange(0, 64))
    if kind == 2:
        return provider.ConsumeUnicodeNoSurrogates(provider.ConsumeIntInRange(0, 64))
    if kind == 3:
        return None
    return [provider.ConsumeBytes(8) for _ in range(provider.ConsumeIntInRange(0, 3))]


def check(data: bytes) -> None:
    provider = atheris.FuzzedDataProvider(data)
    plan = LeasePlan(tuple(_ask(i) for i in range(provider.ConsumeIntInRange(0, 3))))
    shape = provider.ConsumeIntInRange(0, 3)
    if shape == 0:
        raw = _value(provider)
    else:
        live, bad = _value(provider), [_value(provider) for _ in range(provider.ConsumeIntInRange(0, 2))]
        raw = [live, bad, provider.ConsumeBytes(atheris.ALL_REMAINING)]
    try:
        _parse_reply(raw, plan)
    except StoreReplyError:
        pass


if __name__ == "__main__":
    fuzz(check)
