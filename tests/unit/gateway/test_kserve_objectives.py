"""KServe streaming requests carry latency targets as parameters ttft_ms / tpot_ms (kserve/stream.py)."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.gateway.kserve import stream as kserve_stream
from tests.unit.gateway.test_kserve_models import _stream_request


def test_ttft_and_tpot_parameters_become_the_requests_objectives():
    parsed = kserve_stream.parse_stream_request(_stream_request(max_tokens=5, ttft_ms=200, tpot_ms=50))
    assert (parsed.generate.objectives.ttft_ms, parsed.generate.objectives.tpot_ms) == (200, 50)
    assert parsed.generate.sampling.max_tokens == 5
    unset = kserve_stream.parse_stream_request(_stream_request())
    assert not unset.generate.HasField("objectives") or unset.generate.objectives.ttft_ms == 0


@pytest.mark.parametrize("value", [0, -5, 2.5, "fast", True])
def test_an_unusable_objective_parameter_is_invalid_naming_it(value):
    with pytest.raises(InvalidArgument, match=r"parameter 'ttft_ms' has an unusable value .*expected an integer"):
        kserve_stream.parse_stream_request(_stream_request(ttft_ms=value))
