"""x-infermesh-ttft-ms / x-infermesh-tpot-ms on the OpenAI HTTP front: 400 naming the bound, else served."""

from __future__ import annotations

import json

import pytest

from tests.openai.conftest import MODEL

pytestmark = pytest.mark.integration

BODY = {"model": MODEL, "prompt": "abc", "max_tokens": 2}


def test_an_objective_header_out_of_bounds_is_400_naming_the_bound(http_mesh):
    status, _headers, raw = http_mesh.post("/completions", BODY, headers={"x-infermesh-tpot-ms": "0.5"})
    assert (status, json.loads(raw)["error"]["message"]) == (
        400, "latency objective out of bounds: TPOT target 0.5 ms is below the minimum 1 ms")
    status, _headers, raw = http_mesh.post("/completions", BODY, headers={"x-infermesh-ttft-ms": "soon"})
    assert (status, json.loads(raw)["error"]["message"]) == (
        400, "x-infermesh-ttft-ms must be a positive number of milliseconds, got 'soon'")


def test_objective_headers_within_the_bounds_are_served(http_mesh):
    status, _headers, _raw = http_mesh.post("/completions", BODY, headers={"x-infermesh-ttft-ms": "30000",
                                                                           "x-infermesh-tpot-ms": "2000"})
    assert status == 200
