"""ModelCatalog.knows: the names any scheduler reported, kept current as reports come and go."""

from __future__ import annotations

from infermesh.v1 import common_pb2, gateway_pb2
from services.gateway.routing.catalog import ModelCatalog


def _info(name: str, ready: bool = True) -> gateway_pb2.ModelInfo:
    return gateway_pb2.ModelInfo(model=common_pb2.ModelRef(name=name, version="1"), ready=ready)


def test_knows_what_any_endpoint_reported_until_it_is_forgotten():
    catalog = ModelCatalog()
    assert not catalog.knows("digits")
    catalog.update("a:1", (_info("digits"),))
    catalog.update("b:1", (_info("tinylm", ready=False),))
    assert catalog.knows("digits") and catalog.knows("tinylm") and not catalog.knows("made-up")
    catalog.update("a:1", ())
    assert not catalog.knows("digits") and catalog.knows("tinylm")
    catalog.forget("b:1")
    assert not catalog.knows("tinylm")


def test_max_seq_len_is_the_largest_reported_for_the_version_or_any_version():
    catalog = ModelCatalog()

    def info(version: str, max_seq_len: int) -> gateway_pb2.ModelInfo:
        return gateway_pb2.ModelInfo(model=common_pb2.ModelRef(name="llm", version=version), max_seq_len=max_seq_len)

    assert catalog.max_seq_len("llm") == 0
    catalog.update("a:1", (info("1", 2048), info("2", 8192)))
    catalog.update("b:1", (info("1", 4096),))
    assert (catalog.max_seq_len("llm", "1"), catalog.max_seq_len("llm"), catalog.max_seq_len("llm", "3")) == (
        4096, 8192, 0)
    assert catalog.max_seq_len("other") == 0
