"""x-infermesh-ttft-ms / x-infermesh-tpot-ms on the OpenAI HTTP front: 400 naming the bound, else served."""

from __future__ import annotations

import json

import pytest

from tests.openai.conftest import MODEL
from tools.testbed.processes import wait_until

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


def test_a_ttft_target_below_one_step_alone_is_400_at_once_naming_both_times(http_mesh):
    # The worker's steps take STEP_MS (20 ms); 10 ms is within the bounds but below one step. The
    # gateway knows the step time from its next pressure poll (every 100 ms here).
    def refused() -> tuple[int, dict]:
        status, _headers, raw = http_mesh.post("/completions", BODY, headers={"x-infermesh-ttft-ms": "10"})
        return status, (json.loads(raw).get("error", {}) if status != 200 else {})

    wait_until(lambda: refused()[0] == 400, timeout_s=10, message="the gateway heard the step time")
    status, error = refused()
    assert error["code"] == "ttft_objective_unmeetable"
    assert error["message"].startswith(f"TTFT target 10 ms cannot be met by model '{MODEL}': one step alone takes ")
