"""attach_codec: the RunStep a worker receives, field by field, for prompt chunks, decodes, block
table resets, untraced and traced steps, and a sequence whose stream is gone; step and batch
results and hellos as the scheduler's logic sees them."""

from __future__ import annotations

from infermesh.v1 import common_pb2, scheduler_pb2
from services.common import errors
from services.common.timings import StageTime
from services.scheduler import attach_codec
from services.scheduler.attach_types import ModelKind
from services.scheduler.fair_queue import TenantContext
from services.scheduler.generate_stream import GenerateStream
from services.scheduler.sequence import SamplingParams
from services.scheduler.step_plan import SequenceStep, StepPlan
from services.scheduler.worker_features import WorkerFeature
from services.worker.builtin_models import ToyGeneratorRuntime
from services.worker.step_codec import run_step_from_proto

SAMPLING = SamplingParams(max_tokens=8, temperature=0.5)


def _step(seq_id: int, token_ids: tuple[int, ...], start: int, new_blocks: tuple[int, ...] = (),
          reset: bool = False, sample: bool = True, num_generated: int = 0) -> SequenceStep:
    return SequenceStep(seq_id=seq_id, token_ids=token_ids, start_position=start, new_blocks=new_blocks,
                        reset_block_table=reset, sample=sample, sampling=SAMPLING, num_generated=num_generated)


def _streams() -> dict[int, GenerateStream]:
    return {
        seq_id: GenerateStream(seq_id=seq_id, tenant=TenantContext("t"), seed=seq_id, trace_context=trace,
                               arrival_s=0.0, deadline_s=None)
        for seq_id, trace in ((1, {"traceparent": "00-aa-bb-01"}), (2, {}), (3, {"traceparent": "00-cc-dd-01"}))
    }


def test_each_field_reaches_the_worker() -> None:
    plan = StepPlan(step_id=7, finished_seq_ids=(9, 10), seqs=(
        _step(1, (5, 6, 7), 0, new_blocks=(3, 4), reset=True, sample=False),  # first prompt chunk, traced
        _step(2, (8,), 12, num_generated=2),  # decode: defaults left out
        _step(3, (9,), 40, new_blocks=(11,), num_generated=30),  # decode crossing a block, not traced
        _step(4, (1, 2), 0, reset=True),  # stream gone (cancelled while scheduled): no sampling
    ))
    command = attach_codec.encode_run_step(plan, _streams())
    # What the worker samples with: temperature, top_p (left at 0, "1"), the stream's seed.
    expected = scheduler_pb2.RunStep(step_id=7, finished_seq_ids=[9, 10], seqs=[
        scheduler_pb2.SequenceStep(seq_id=1, token_ids=[5, 6, 7], start_position=0, new_blocks=[3, 4],
                                   reset_block_table=True, sample=False,
                                   sampling=common_pb2.SamplingParams(temperature=0.5, seed=1),
                                   trace_context={"traceparent": "00-aa-bb-01"}),
        scheduler_pb2.SequenceStep(seq_id=2, token_ids=[8], start_position=12, sample=True, num_generated=2,
                                   sampling=common_pb2.SamplingParams(temperature=0.5, seed=2)),
        scheduler_pb2.SequenceStep(seq_id=3, token_ids=[9], start_position=40, new_blocks=[11], sample=True,
                                   num_generated=30,
                                   sampling=common_pb2.SamplingParams(temperature=0.5, seed=3)),
        scheduler_pb2.SequenceStep(seq_id=4, token_ids=[1, 2], start_position=0, reset_block_table=True,
                                   sample=True),
    ])
    assert command == expected


def test_a_step_result_splits_tokens_from_failures() -> None:
    result = scheduler_pb2.StepResult(step_id=3, outputs=[
        scheduler_pb2.SequenceOutput(seq_id=1, token_id=42),
        scheduler_pb2.SequenceOutput(seq_id=2, error=scheduler_pb2.ItemError(code=13, message="nan logits")),
    ], timings=common_pb2.Timings(total_us=2500))
    outcome = attach_codec.decode_step_result(result)
    assert (outcome.token_ids, outcome.worker_total_s) == ({1: 42}, 0.0025)
    assert list(outcome.failures) == [2] and isinstance(outcome.failures[2], errors.Internal)
    assert outcome.failures[2].message == "nan logits"


def test_a_batch_result_keeps_labels_item_errors_and_the_workers_stages() -> None:
    result = scheduler_pb2.BatchResult(batch_id=5, items=[
        scheduler_pb2.ItemResult(item_id=1, labels=[common_pb2.Label(label="7", index=7, score=0.9)]),
        scheduler_pb2.ItemResult(item_id=2, error=scheduler_pb2.ItemError(code=3, message="not an image")),
    ], timings=common_pb2.Timings(total_us=900, stages=[
        common_pb2.StageTiming(stage=common_pb2.STAGE_COMPUTE, duration_us=800, service="worker")]))
    outcome = attach_codec.decode_batch_result(result)
    assert outcome.items[1].labels[0].label == "7" and outcome.items[1].labels[0].score > 0.89
    assert isinstance(outcome.items[2].error, errors.InvalidArgument)
    assert outcome.items[2].error.message == "not an image"
    assert outcome.worker_stages == (StageTime("compute", 800, "worker"),) and outcome.worker_total_us == 900


def test_a_hello_decodes_to_what_the_worker_declared() -> None:
    hello = attach_codec.decode_hello(ToyGeneratorRuntime("1").hello("w1"))
    assert hello.worker_id == "w1" and hello.kind is ModelKind.GENERATOR
    assert hello.capacity.num_kv_blocks > 0 and hello.tokenizer.vocab_size > 0
    assert attach_codec.decode_hello(scheduler_pb2.WorkerHello()).kind is None


def test_an_older_workers_hello_declares_no_features_and_an_unknown_one_is_skipped() -> None:
    assert attach_codec.decode_hello(ToyGeneratorRuntime("1").hello("w1")).features == frozenset()
    declared = scheduler_pb2.WorkerHello(features=[scheduler_pb2.WORKER_FEATURE_GRAMMAR_AFTER_REASONING, 99])
    assert attach_codec.decode_hello(declared).features == {WorkerFeature.GRAMMAR_AFTER_REASONING}


def test_a_table_starting_with_cached_blocks_tells_the_worker_how_many_positions_are_valid() -> None:
    cached = SequenceStep(seq_id=1, token_ids=(7,), start_position=32, new_blocks=(5, 6, 2), reset_block_table=True,
                          sample=True, sampling=SAMPLING, num_generated=0, num_cached_tokens=32)
    plan = StepPlan(step_id=1, seqs=(cached, _step(2, (8,), 12)), finished_seq_ids=())
    command = attach_codec.encode_run_step(plan, _streams())
    assert command.seqs[0].num_cached_tokens == 32 and command.seqs[1].num_cached_tokens == 0
    assert command.seqs[0].trace_context == {"traceparent": "00-aa-bb-01"}  # a first step is traced
    worker_side = run_step_from_proto(scheduler_pb2.RunStep.FromString(command.SerializeToString()))
    assert [s.num_cached_tokens for s in worker_side.seqs] == [32, 0]
