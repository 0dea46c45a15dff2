"""SIGTERM to a worker under steady load: it stops taking work, finishes what it has, detaches.

Counted, not sampled: every request sent gets a correct answer.
"""

from __future__ import annotations

import functools
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.worker.mock_models import MOCK_LABELS, mock_label_index
from tools.testbed import session_tls
from tools.testbed.generator_models import mock_text
from tools.testbed.processes import running_mesh, wait_until

pytestmark = pytest.mark.integration

BRIGHT = common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes([250] * 12), height=2, width=2, channels=3))


def _steady_load(address: str, make_call, stop: threading.Event, rate_per_s: float) -> list:
    """Open-loop calls at a fixed rate until `stop`; returns each call's outcome."""
    outcomes: list = []
    with session_tls.channel(address) as channel, ThreadPoolExecutor(max_workers=16) as pool:
        stub = gateway_pb2_grpc.InferenceStub(channel)
        futures = []
        next_send = time.monotonic()
        while not stop.is_set():
            futures.append(pool.submit(make_call, stub))
            next_send += 1 / rate_per_s
            time.sleep(max(0.0, next_send - time.monotonic()))
        for future in futures:
            outcomes.append(future.result())
    return outcomes


def _classify(model: str, stub) -> str:
    try:
        reply = stub.Classify(gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name=model),
                                                          image=BRIGHT), timeout=10)
        return reply.labels[0].label
    except grpc.RpcError as exc:
        return f"{exc.code().name}: {exc.details()}"


def _generate(model: str, stub) -> str:
    request = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name=model), prompt="a",
                                          sampling=common_pb2.SamplingParams(max_tokens=12))
    try:
        chunks = list(stub.Generate(request, timeout=20))
    except grpc.RpcError as exc:
        return f"{exc.code().name}: {exc.details()}"
    indexes = [c.index for c in chunks if c.token_ids]
    assert indexes == list(range(len(indexes))), "no token skipped or repeated"
    return "".join(c.text for c in chunks)


@pytest.mark.parametrize(
    ("model", "call", "expected", "worker_args", "rate_per_s"),
    [
        ("toy-classifier", _classify, "bright", ("--toy-compute-ms", "30"), 40.0),
        ("toy-generator", _generate, "bcdefghijklm", ("--toy-compute-ms", "40"), 6.0),
        ("mock-classifier", _classify, MOCK_LABELS[mock_label_index(BRIGHT)], ("--mock-profile", "batch_ms=30"), 40.0),
        ("mock-generator", _generate, mock_text("a", 12), ("--mock-profile", "step_ms=40"), 6.0),
    ],
)
def test_sigterm_to_a_worker_under_load_fails_no_request(tmp_path, model, call, expected, worker_args, rate_per_s):
    call = functools.partial(call, model)
    with running_mesh(tmp_path) as mesh:
        mesh.start_scheduler()
        draining = mesh.start_worker(model, *worker_args, "--drain-grace-s", "15", name="draining")
        mesh.start_worker(model, *worker_args, name="staying")
        mesh.start_gateway()
        stop = threading.Event()
        results: list = []
        loader = threading.Thread(target=lambda: results.extend(_steady_load(mesh.gateway.address, call, stop, rate_per_s)))
        loader.start()
        time.sleep(1.5)
        draining.signal(signal.SIGTERM)
        exit_code = draining.proc.wait(timeout=20)
        time.sleep(1.0)
        stop.set()
        loader.join(timeout=60)
        assert exit_code == 0, draining.log_tail()
        failures = [r for r in results if r != expected]
        assert len(results) >= 2 * rate_per_s
        assert failures == [], f"{len(failures)} of {len(results)} failed: {failures[:3]}\n{mesh.logs()}"
        wait_until(lambda: "detached" in mesh.scheduler.log_tail(200), timeout_s=5, message="scheduler saw detach")
