"""atheris: the shared quota store's sync reply as the gateway parses it
(services/gateway/quota/store.py: _parse_reply of the Lua script's [live, bad keys, JSON grants, store time],
or its ["late", store time])."""

from __future__ import annotations

import json
import math

import atheris

from fuzz.harness import fuzz

with atheris.instrument_imports(include=["services.gateway.quota.store"]):
    from services.gateway.quota.lease import LeasePlan, TenantAsk
    from services.gateway.quota.store import StoreReplyError, _parse_reply
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


def _grant(provider: atheris.FuzzedDataProvider) -> object:
    """One grant value as the script's JSON could hold it: mostly numbers, sometimes anything else."""
    kind = provider.ConsumeIntInRange(0, 7)
    if kind <= 2:
        return provider.ConsumeRegularFloat() if kind else provider.ConsumeInt(4)
    if kind == 3:
        return provider.PickValueInList([math.nan, math.inf, -math.inf, 10**400, -(10**400), True])
    if kind == 4:
        return provider.ConsumeUnicodeNoSurrogates(8)
    return provider.PickValueInList([None, {}, [], {"a": 1}])


def _grants(provider: atheris.FuzzedDataProvider, num_asks: int) -> bytes:
    """The reply's JSON text: a list of about 3 values per tenant, or raw bytes."""
    if provider.ConsumeIntInRange(0, 4) == 0:
        return provider.ConsumeBytes(provider.ConsumeIntInRange(0, 64))
    length = max(0, 3 * num_asks + provider.ConsumeIntInRange(-1, 1))
    return json.dumps([_grant(provider) for _ in range(length)]).encode()


def check(data: bytes) -> None:
    provider = atheris.FuzzedDataProvider(data)
    plan = LeasePlan(tuple(_ask(i) for i in range(provider.ConsumeIntInRange(0, 3))))
    if provider.ConsumeIntInRange(0, 7) == 0:
        raw = _value(provider)  # not the script's [live, bad keys, grants, store time] shape at all
    elif provider.ConsumeIntInRange(0, 7) == 0:
        raw = [provider.PickValueInList([b"late", "late", b"lat"]), _value(provider)]
    else:
        live, bad = _value(provider), [_value(provider) for _ in range(provider.ConsumeIntInRange(0, 2))]
        raw = [live, bad, _grants(provider, len(plan.asks)), _value(provider)]
    try:
        _parse_reply(raw, plan)
    except StoreReplyError:
        pass


if __name__ == "__main__":
    fuzz(check)
