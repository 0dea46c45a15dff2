"""Embedding requests through the scheduler: a prefill-only sequence (chunked like any prompt) that ends
with the worker's vector on the step reaching the prompt's end, nothing generated and its blocks freed at
once; it reads nothing from the prefix cache; a worker that sends no vector fails it; several are batched
in one step; the task checks name the field, and the vector's fields travel on the wire both ways."""

from __future__ import annotations

import pytest

from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2
from services.common import errors
from services.scheduler import attach_codec
from services.scheduler.attach_session import check_hello
from services.scheduler.attach_types import EmbeddingInfo, ModelKey, ModelKind
from services.scheduler.embed_request import check_task, shaped
from services.scheduler.sequence import AbortReason, FinishReason, SamplingParams
from services.scheduler.step_plan import StepPlan

from .conftest import FakePagedWorker, make_scheduler, tenant

EMBED = SamplingParams(max_tokens=1, embed=True)
PROMPT = tuple(range(60, 100))  # 40 tokens: two chunks under a 32-token budget
MODEL = ModelKey("emb", "1")
INFO = EmbeddingInfo(dimensions=4, normalize=True, matryoshka=True, pooling="mean")


def _vectors(plan: StepPlan) -> dict[int, tuple[float, ...]]:
    """What a worker returns for the plan's sequences that reach their prompt's end: a vector naming the seq."""
    return {s.seq_id: (float(s.seq_id), 0.0, 0.0, 1.0) for s in plan.seqs if s.sample}


def _run(scheduler, worker: FakePagedWorker, vectors=_vectors, num_steps: int = 20) -> tuple[list, list]:
    plans, deltas = [], []
    for _ in range(num_steps):
        plan = scheduler.schedule()
        if not plan.has_work():
            break
        plans.append(plan)
        deltas += scheduler.update_from_output(plan, worker.run(plan), None, None, None, vectors(plan))
    return plans, deltas


def test_an_embedding_is_a_chunked_prefill_that_ends_with_the_workers_vector(clock) -> None:
    scheduler = make_scheduler(clock)
    scheduler.add_request(1, PROMPT, EMBED, tenant(), deadline_s=None)
    plans, deltas = _run(scheduler, FakePagedWorker(4))
    assert [(s.start_position, len(s.token_ids), s.sample) for p in plans for s in p.seqs] == [(0, 32, False),
                                                                                                (32, 8, True)]
    (delta,) = deltas
    assert (delta.embedding, delta.finish_reason, delta.num_generated, delta.token_ids) == (
        (1.0, 0.0, 0.0, 1.0), FinishReason.STOP, 0, ())
    assert delta.num_prompt_tokens == len(PROMPT)
    assert scheduler.num_unfinished == 0 and scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_several_embeddings_share_steps(clock) -> None:
    scheduler = make_scheduler(clock)
    for seq_id in (1, 2, 3):
        scheduler.add_request(seq_id, PROMPT[:8], EMBED, tenant(), deadline_s=None)
    plans, deltas = _run(scheduler, FakePagedWorker(4))
    assert len(plans) == 1 and len(plans[0].seqs) == 3
    assert sorted(d.embedding[0] for d in deltas) == [1.0, 2.0, 3.0]


def test_an_embedding_reads_nothing_from_the_prefix_cache(clock) -> None:
    scheduler = make_scheduler(clock, enable_prefix_cache=True)
    worker = FakePagedWorker(4)
    scheduler.add_request(1, PROMPT, SamplingParams(max_tokens=1), tenant(), deadline_s=None)
    _run(scheduler, worker)
    scheduler.add_request(2, PROMPT, EMBED, tenant(), deadline_s=None)
    plans, deltas = _run(scheduler, worker)
    assert plans[0].seqs[0].start_position == 0 and plans[0].seqs[0].num_cached_tokens == 0
    assert deltas[-1].embedding


def test_a_worker_that_sends_no_vector_fails_the_sequence(clock) -> None:
    scheduler = make_scheduler(clock)
    scheduler.add_request(1, PROMPT[:8], EMBED, tenant(), deadline_s=None)
    _, deltas = _run(scheduler, FakePagedWorker(4), vectors=lambda plan: {})
    assert deltas[-1].abort_reason is AbortReason.FAILED and not deltas[-1].embedding


def test_an_embedding_may_fill_the_context_a_generation_may_not(clock) -> None:
    scheduler = make_scheduler(clock, max_seq_len=40)
    scheduler.add_request(1, PROMPT, EMBED, tenant(), deadline_s=None)
    with pytest.raises(errors.InvalidArgument, match="exceeds the model's max_seq_len 40"):
        scheduler.add_request(2, PROMPT, SamplingParams(max_tokens=1), tenant(), deadline_s=None)


def test_each_task_is_refused_for_the_other_kind_of_model() -> None:
    embed = gateway_pb2.GenerateRequest(prompt="a", embed=gateway_pb2.EmbedOptions())
    with pytest.raises(errors.InvalidArgument, match="^embed: model emb:1 is not an embedding model"):
        check_task(embed, MODEL, None)
    with pytest.raises(errors.InvalidArgument, match="model emb:1 is an embedding model"):
        check_task(gateway_pb2.GenerateRequest(prompt="a"), MODEL, INFO)
    assert check_task(gateway_pb2.GenerateRequest(prompt="a"), MODEL, None) is None
    assert check_task(embed, MODEL, INFO) is None
    chat = gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="user", content="a")],
                                       embed=gateway_pb2.EmbedOptions())
    assert check_task(chat, MODEL, INFO) is None  # rendered through the chat template, as vLLM's chat embeddings
    chat.tools.add(name="f")
    with pytest.raises(errors.InvalidArgument, match="^embed: tools cannot be embedded"):
        check_task(chat, MODEL, INFO)


def test_dimensions_only_for_a_matryoshka_model_within_its_dimensions() -> None:
    def asking(n: int) -> gateway_pb2.GenerateRequest:
        return gateway_pb2.GenerateRequest(prompt="a", embed=gateway_pb2.EmbedOptions(dimensions=n))

    assert check_task(asking(2), MODEL, INFO) == 2
    with pytest.raises(errors.InvalidArgument, match=r"^embed.dimensions must be in \[1, 4\].*got 5"):
        check_task(asking(5), MODEL, INFO)
    with pytest.raises(errors.InvalidArgument, match="^embed.dimensions: .*not a Matryoshka model"):
        check_task(asking(2), MODEL, EmbeddingInfo(4, True, False, "last"))


def test_a_shortened_vector_is_renormalized_where_the_model_normalizes() -> None:
    assert shaped([0.6, 0.8, 0.0], None, True) == [0.6, 0.8, 0.0]
    assert shaped([3.0, 4.0, 1.0], 2, False) == [3.0, 4.0]
    assert shaped([3.0, 4.0, 1.0], 2, True) == pytest.approx([0.6, 0.8])


def test_the_spec_and_the_vector_travel_on_the_wire() -> None:
    hello = attach_codec.decode_hello(scheduler_pb2.WorkerHello(
        kind=common_pb2.MODEL_KIND_EMBEDDING,
        embedding=scheduler_pb2.EmbeddingSpec(dimensions=4, normalize=True, matryoshka=True, pooling="mean")))
    assert (hello.kind, hello.embedding) == (ModelKind.GENERATOR, INFO)  # scheduled as a generator
    plain = attach_codec.decode_hello(scheduler_pb2.WorkerHello(kind=common_pb2.MODEL_KIND_GENERATOR))
    assert (plain.kind, plain.embedding) == (ModelKind.GENERATOR, None)
    with pytest.raises(errors.InvalidArgument, match="must declare embedding.dimensions >= 1"):
        check_hello(attach_codec.decode_hello(scheduler_pb2.WorkerHello(
            worker_id="w", model=common_pb2.ModelRef(name="m", version="1"), kind=common_pb2.MODEL_KIND_EMBEDDING,
            capacity=scheduler_pb2.WorkerCapacity(num_kv_blocks=4, block_size=4))))
    outcome = attach_codec.decode_step_result(scheduler_pb2.StepResult(outputs=[
        scheduler_pb2.SequenceOutput(seq_id=3, embedding=[0.5, -0.5]), scheduler_pb2.SequenceOutput(seq_id=4)]))
    assert outcome.embeddings == {3: (0.5, -0.5)}
