"""The mock worker over the real Attach protocol: exact deterministic streams through the scheduler,
hundreds of sequences on two workers, aborts that free blocks, drain, and the mock classifier."""

from __future__ import annotations

import asyncio
import signal

import pytest

from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.worker.mock_models import MOCK_LABELS, mock_label_index
from tools.testbed import session_tls
from tools.testbed.generator_models import MOCK, mock_text
from tools.testbed.processes import running_mesh
from tools.testbed.scheduler_fixtures import (
    pressure_of,
    read_stream,
    scheduler_stub,
    tenant,
    wait_for_idle_kv,
    wait_for_workers,
)

pytestmark = pytest.mark.integration

PROFILE = "step_ms=5,block_size=16,num_kv_blocks=2048,max_num_seqs=256,max_num_batched_tokens=2048"


def _seeded(prompt: str, max_tokens: int, seed: int) -> scheduler_pb2.ScheduleGenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=seed)
    return scheduler_pb2.ScheduleGenerateRequest(
        request=gateway_pb2.GenerateRequest(model=MOCK.ref, prompt=prompt, sampling=sampling), tenant=tenant("t"))


def test_greedy_and_seeded_streams_are_exactly_the_mock_tokens(tmp_path):
    with running_mesh(tmp_path) as mesh:
        mesh.start_scheduler()
        mesh.start_worker(MOCK.name, "--mock-profile", PROFILE)
        with scheduler_stub(mesh.scheduler.address) as stub:
            wait_for_workers(stub, MOCK.ref, 1)
            greedy = read_stream(stub.Generate(MOCK.request("The value of ", 40), timeout=10))
            seeded = read_stream(stub.Generate(_seeded("The value of ", 40, seed=1234), timeout=10))
            assert greedy.text == mock_text("The value of ", 40)
            assert seeded.text == mock_text("The value of ", 40, seed=1234) != greedy.text
            assert greedy.indexes == list(range(40)) and greedy.finish_reason == common_pb2.FINISH_REASON_LENGTH
            wait_for_idle_kv(stub, MOCK.ref)


async def _many_streams(address: str, prompts: list[str], max_tokens: int) -> list[str]:
    async with session_tls.aio_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)

        async def one(prompt: str) -> str:
            return "".join([r.chunk.text async for r in stub.Generate(MOCK.request(prompt, max_tokens), timeout=60)])

        return await asyncio.gather(*(one(p) for p in prompts))


def test_hundreds_of_sequences_on_two_mock_workers_all_stream_exactly(tmp_path):
    prompts = [f"request {i} says " for i in range(300)]
    with running_mesh(tmp_path) as mesh:
        mesh.start_scheduler()
        mesh.start_worker(MOCK.name, "--mock-profile", PROFILE, name="mock-a")
        mesh.start_worker(MOCK.name, "--mock-profile", PROFILE, name="mock-b")
        with scheduler_stub(mesh.scheduler.address) as stub:
            wait_for_workers(stub, MOCK.ref, 2)
            texts = asyncio.run(_many_streams(mesh.scheduler.address, prompts, 24))
            assert texts == [mock_text(p, 24) for p in prompts]
            wait_for_idle_kv(stub, MOCK.ref)
        for worker in ("mock-a", "mock-b"):
            assert "attached to scheduler" in mesh.processes[[p.name for p in mesh.processes].index(worker)].log_tail()


def test_cancelled_stream_is_aborted_on_the_worker_and_its_blocks_freed(tmp_path):
    with running_mesh(tmp_path) as mesh:
        mesh.start_scheduler()
        mesh.start_worker(MOCK.name, "--mock-profile", "step_ms=20")
        with scheduler_stub(mesh.scheduler.address) as stub:
            wait_for_workers(stub, MOCK.ref, 1)
            call = stub.Generate(MOCK.request("abc", 400), timeout=30)
            for _ in range(5):
                next(call)
            assert pressure_of(stub, MOCK.ref).kv_usage > 0
            call.cancel()
            assert wait_for_idle_kv(stub, MOCK.ref, timeout_s=2.0) < 1.0


def test_draining_mock_worker_finishes_its_streams_then_detaches(tmp_path):
    with running_mesh(tmp_path) as mesh:
        mesh.start_scheduler()
        worker = mesh.start_worker(MOCK.name, "--mock-profile", "step_ms=20", "--drain-grace-s", "10")
        with scheduler_stub(mesh.scheduler.address) as stub:
            wait_for_workers(stub, MOCK.ref, 1)
            texts, finish = [], common_pb2.FINISH_REASON_UNSPECIFIED
            for response in stub.Generate(MOCK.request("xyz", 30), timeout=30):
                if not texts:
                    worker.signal(signal.SIGTERM)  # mid-stream: 29 tokens still to come
                texts.append(response.chunk.text)
                finish = response.chunk.finish_reason or finish
            assert "".join(texts) == mock_text("xyz", 30)
            assert finish == common_pb2.FINISH_REASON_LENGTH
            assert worker.proc.wait(timeout=15) == 0
            assert pressure_of(stub, MOCK.ref) is None or pressure_of(stub, MOCK.ref).num_workers == 0


def test_mock_classifier_labels_each_image_by_its_bytes(tmp_path):
    model = common_pb2.ModelRef(name="mock-classifier")
    images = [common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes([i] * 4), height=2, width=2, channels=1))
              for i in range(6)]
    with running_mesh(tmp_path) as mesh:
        mesh.start_scheduler()
        mesh.start_worker("mock-classifier", "--mock-profile", "batch_ms=2")
        with scheduler_stub(mesh.scheduler.address) as stub:
            wait_for_workers(stub, model, 1)
            labels = [stub.Classify(scheduler_pb2.ScheduleClassifyRequest(
                request=gateway_pb2.ClassifyRequest(model=model, image=image), tenant=tenant("t")),
                timeout=10).response.labels[0].label for image in images]
    assert labels == [MOCK_LABELS[mock_label_index(image)] for image in images]
