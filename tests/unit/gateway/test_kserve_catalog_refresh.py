"""KServeCore.model: callers that miss the catalog together share one refresh, none fails while it runs.

CI found the race: twelve concurrent ModelInfer calls right after start; the first miss started a
refresh, and the others, inside the refresh interval, failed NOT_FOUND before it answered.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from infermesh.v1 import common_pb2, gateway_pb2
from services.common import errors
from services.gateway.kserve.core import KServeCore
from services.gateway.routing.catalog import ModelCatalog


def _core(catalog: ModelCatalog, refresh) -> KServeCore:
    routing = SimpleNamespace(model=lambda name: SimpleNamespace(default_version=""))
    admission = SimpleNamespace(parts=SimpleNamespace(routing=routing))
    return KServeCore(admission=admission, catalog=catalog, refresh_catalog=refresh,  # type: ignore[arg-type]
                      classify=None, generate=None)  # type: ignore[arg-type]


def _info(name: str) -> gateway_pb2.ModelInfo:
    return gateway_pb2.ModelInfo(model=common_pb2.ModelRef(name=name, version="1"), ready=True)


class _Refresh:
    """A catalog refresh that takes a while and then finds `found` (if any); counts its calls."""

    def __init__(self, catalog: ModelCatalog, found: str | None) -> None:
        self.catalog, self.found, self.calls = catalog, found, 0

    async def __call__(self) -> None:
        self.calls += 1
        await asyncio.sleep(0.05)
        if self.found:
            self.catalog.update("scheduler-1", (_info(self.found),))


async def test_concurrent_misses_wait_for_the_one_refresh_in_flight():
    catalog = ModelCatalog()
    refresh = _Refresh(catalog, "cnn")
    core = _core(catalog, refresh)
    infos = await asyncio.gather(*(core.model("cnn", "") for _ in range(12)))
    assert [i.model.name for i in infos] == ["cnn"] * 12
    assert refresh.calls == 1


async def test_an_unknown_model_is_not_found_and_refreshes_stay_rate_limited():
    catalog = ModelCatalog()
    refresh = _Refresh(catalog, None)
    core = _core(catalog, refresh)
    for _ in range(5):
        with pytest.raises(errors.NotFound, match="is not served here"):
            await core.model("nope", "")
    assert refresh.calls == 1
