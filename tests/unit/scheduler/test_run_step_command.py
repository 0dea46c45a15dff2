"""GeneratePool.run_step_command: the RunStep a worker receives, field by field, for prompt chunks,
decodes, block table resets, untraced and traced steps, and a sequence whose stream is gone."""

from __future__ import annotations

import asyncio

from infermesh.v1 import common_pb2, scheduler_pb2
from services.scheduler.config import SchedulerConfig
from services.scheduler.fair_queue import TenantContext
from services.scheduler.generate_pool import GeneratePool, GenerateStream
from services.scheduler.sequence import SamplingParams
from services.scheduler.step_plan import SequenceStep, StepPlan
from tests.unit.scheduler.test_generate_pool import MODEL, hello

SAMPLING = SamplingParams(max_tokens=8)


def _step(seq_id: int, token_ids: tuple[int, ...], start: int, new_blocks: tuple[int, ...] = (),
          reset: bool = False, sample: bool = True, num_generated: int = 0) -> SequenceStep:
    return SequenceStep(seq_id=seq_id, token_ids=token_ids, start_position=start, new_blocks=new_blocks,
                        reset_block_table=reset, sample=sample, sampling=SAMPLING, num_generated=num_generated)


def _pool_with_streams() -> GeneratePool:
    pool = GeneratePool(MODEL, hello("w"), SchedulerConfig())
    for seq_id, trace in ((1, {"traceparent": "00-aa-bb-01"}), (2, {}), (3, {"traceparent": "00-cc-dd-01"})):
        pool._streams[seq_id] = GenerateStream(
            seq_id=seq_id, tenant=TenantContext("t"),
            sampling_proto=common_pb2.SamplingParams(max_tokens=8, temperature=0.5, seed=seq_id),
            trace_context=trace, arrival_s=0.0, deadline_s=None)
    return pool


def test_each_field_reaches_the_worker() -> None:
    async def main() -> scheduler_pb2.RunStep:
        pool = _pool_with_streams()
        plan = StepPlan(step_id=7, finished_seq_ids=(9, 10), seqs=(
            _step(1, (5, 6, 7), 0, new_blocks=(3, 4), reset=True, sample=False),  # first prompt chunk, traced
            _step(2, (8,), 12, num_generated=2),  # decode: defaults left out
            _step(3, (9,), 40, new_blocks=(11,), num_generated=30),  # decode crossing a block, not traced
            _step(4, (1, 2), 0, reset=True),  # stream gone (cancelled while scheduled): no sampling
        ))
        return pool.run_step_command(plan)

    command = asyncio.run(main())
    expected = scheduler_pb2.RunStep(step_id=7, finished_seq_ids=[9, 10], seqs=[
        scheduler_pb2.SequenceStep(seq_id=1, token_ids=[5, 6, 7], start_position=0, new_blocks=[3, 4],
                                   reset_block_table=True, sample=False,
                                   sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0.5, seed=1),
                                   trace_context={"traceparent": "00-aa-bb-01"}),
        scheduler_pb2.SequenceStep(seq_id=2, token_ids=[8], start_position=12, sample=True, num_generated=2,
                                   sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0.5, seed=2)),
        scheduler_pb2.SequenceStep(seq_id=3, token_ids=[9], start_position=40, new_blocks=[11], sample=True,
                                   num_generated=30,
                                   sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0.5, seed=3)),
        scheduler_pb2.SequenceStep(seq_id=4, token_ids=[1, 2], start_position=0, reset_block_table=True,
                                   sample=True),
    ])
    assert command == expected
    assert not command.seqs[3].HasField("sampling")
    assert command.SerializeToString(deterministic=True) == expected.SerializeToString(deterministic=True)
