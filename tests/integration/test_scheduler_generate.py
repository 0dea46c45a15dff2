"""Generate at the scheduler's own RPC, real processes: cancellation and deadlines free KV blocks,
pressure and metrics report it.

One toy generator worker (25 ms per step); the scheduler runs one sequence at a time
(`--max-num-seqs 1`) so a second one provably waits in the queue, and keeps 200 ms of each
deadline for itself (`--deadline-margin-ms 200`) so its own expiry, not the client's, ends a stream.
"""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from infermesh.v1 import common_pb2
from tools.testbed.processes import free_port, running_mesh
from tools.testbed.scheduler_fixtures import (
    GENERATOR,
    generate_request,
    pressure_of,
    read_stream,
    scheduler_stub,
    toy_continuation,
    wait_for_idle_kv,
    wait_for_workers,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    metrics_port = free_port()
    with running_mesh(tmp_path_factory.mktemp("scheduler-generate")) as mesh:
        mesh.start_scheduler("--max-num-seqs", "1", "--deadline-margin-ms", "200",
                             "--metrics-port", str(metrics_port))
        mesh.start_worker("toy-generator", "--toy-compute-ms", "25")
        mesh.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        with scheduler_stub(mesh.scheduler.address) as stub:
            wait_for_workers(stub, GENERATOR, 1)
        yield mesh


@pytest.fixture
def stub(mesh):
    with scheduler_stub(mesh.scheduler.address) as stub:
        yield stub


def test_stream_at_the_scheduler_gives_the_models_exact_tokens(stub):
    record = read_stream(stub.Generate(generate_request("xyz", 30), timeout=10))
    assert record.text == toy_continuation("xyz", 30)
    assert record.indexes == list(range(30)) and record.finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_cancelling_a_stream_mid_way_frees_its_kv_blocks(stub):
    call = stub.Generate(generate_request("abc", 400), timeout=30)
    for _ in range(5):
        next(call)
    assert pressure_of(stub, GENERATOR).kv_usage > 0
    call.cancel()
    assert wait_for_idle_kv(stub, GENERATOR, timeout_s=2.0) < 1.0


def test_deadline_in_the_running_set_ends_the_stream_and_frees_blocks(stub):
    call = stub.Generate(generate_request("abc", 400), timeout=0.8)
    chunks = []
    with pytest.raises(grpc.RpcError) as caught:
        for response in call:
            chunks.append(response.chunk)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert caught.value.details().startswith("deadline passed after ")
    assert len(chunks) >= 5, "it was running, not queued"
    wait_for_idle_kv(stub, GENERATOR, timeout_s=2.0)


def test_deadline_in_the_queue_fails_the_waiting_sequence_before_any_step(stub):
    long_call = stub.Generate(generate_request("abc", 400), timeout=30)
    next(long_call)  # it holds the only running slot
    began = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(generate_request("klm", 5), timeout=0.6))
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert caught.value.details() == "deadline passed while waiting for admission"
    assert time.monotonic() - began < 0.6, "the scheduler's own deadline (minus its margin) fired"
    assert pressure_of(stub, GENERATOR).queue_depth == 0
    long_call.cancel()
    wait_for_idle_kv(stub, GENERATOR, timeout_s=2.0)


def test_pressure_reports_waiting_sequences_and_their_estimated_wait(stub):
    long_call = stub.Generate(generate_request("abc", 400), timeout=30)
    next(long_call)
    results = []
    waiting = threading.Thread(
        target=lambda: results.append(read_stream(stub.Generate(generate_request("pqr", 3), timeout=30)))
    )
    waiting.start()
    try:
        deadline = time.monotonic() + 5
        while (pressure := pressure_of(stub, GENERATOR)).queue_depth < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pressure.queue_depth == 1 and pressure.num_workers == 1
        assert 0 < pressure.kv_usage < 1
        standard = pressure.est_queue_time_us[common_pb2.PRIORITY_STANDARD]
        assert standard > 0 and pressure.min_service_time_us > 0
    finally:
        long_call.cancel()
        waiting.join(timeout=10)
    assert results[0].text == toy_continuation("pqr", 3)


def test_metrics_count_requests_by_code_and_time_tokens(mesh, stub):
    read_stream(stub.Generate(generate_request("def", 10), timeout=10))
    text = urllib.request.urlopen(mesh.metrics_url, timeout=5).read().decode()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }

    def value(name: str, **labels: str) -> float:
        key = (name, tuple(sorted({"model": "toy-generator", **labels}.items())))
        assert key in samples, f"no sample {key}"
        return samples[key]

    assert value("infermesh_scheduler_requests_total", tenant="tests", code="OK") >= 1
    assert value("infermesh_scheduler_requests_total", tenant="tests", code="DEADLINE_EXCEEDED") >= 2
    # By the version that served them, as the gateway's request metrics are (canary vs baseline).
    assert value("infermesh_scheduler_time_to_first_token_seconds_count", version="1") >= 1
    assert value("infermesh_scheduler_time_per_output_token_seconds_count", version="1") >= 1
    assert value("infermesh_scheduler_inter_token_latency_seconds_count") >= 9
    assert value("infermesh_scheduler_e2e_latency_seconds_count", kind="generate") >= 1
    assert value("infermesh_scheduler_queue_time_seconds_count", priority="standard") >= 1
    assert value("infermesh_scheduler_batch_size_count") >= 10
    assert value("infermesh_scheduler_attached_workers", version="1") == 1
    kv_usage = [v for (name, _), v in samples.items() if name == "infermesh_scheduler_kv_cache_usage_ratio"]
    assert kv_usage == [0.0], "one worker, all its blocks free again"
    assert value("infermesh_scheduler_running_sequences") == 0
    assert value("infermesh_scheduler_waiting_sequences") == 0
    assert all(value("infermesh_scheduler_queue_depth", priority=p) == 0 for p in ("critical", "standard", "sheddable"))
    assert "infermesh_scheduler_preemptions_total" in text
