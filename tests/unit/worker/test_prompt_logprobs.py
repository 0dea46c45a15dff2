"""Prompt logprobs at the worker: the raw log_softmax of the logits before each prompt token, over
chunked prefill (a chunk predicts its own tokens after the first, then the next chunk's first), equal
to the dense forward's within float noise, and on the wire to the scheduler."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from infermesh.v1 import common_pb2, scheduler_pb2
from services.common.logprobs import PositionLogprobs, TokenLogprob
from services.worker.prompt_logprobs import chunk_targets, prompt_logprobs
from services.worker.repository.loader import LoadedModel
from services.worker.step_codec import run_step_from_proto, step_result_to_proto
from services.worker.step_executor import StepExecutor
from services.worker.work import ErrorCode, RunStep, SamplingParams, SequenceOutput, SequenceStep

BOS = 257
PROMPT = (BOS, *b"The value of a variable is")
# float32 logits through two forwards (paged chunks vs one dense pass), float32 log_softmax against
# float64: they agree to about 1e-5 here; 1e-4 leaves room for other CPUs' kernels.
ATOL = 1e-4


def test_each_row_reports_its_target_and_the_k_most_likely_ties_by_lower_id() -> None:
    logits = np.array([[0.0, 2.0, 2.0, 1.0], [5.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    got = prompt_logprobs(logits, (3, 0), 2)
    first = logits[0] - np.log(np.exp(logits[0]).sum())
    assert got[0].token == TokenLogprob(3, pytest.approx(float(first[3])))
    assert [t.token_id for t in got[0].top] == [1, 2]
    assert [t.token_id for t in got[1].top] == [0, 1]
    assert prompt_logprobs(logits, (3, 0), 0)[1].top == ()


def test_a_tie_across_the_kth_place_goes_to_the_lower_ids() -> None:
    flat = np.zeros((1, 64), dtype=np.float32)
    assert [t.token_id for t in prompt_logprobs(flat, (9,), 3)[0].top] == [0, 1, 2]


def test_a_chunk_predicts_its_tokens_after_the_first_then_the_next_chunks_first() -> None:
    assert chunk_targets((5, 6, 7), 8) == (6, 7, 8)
    assert chunk_targets((5, 6, 7), None) == (6, 7)
    assert chunk_targets((5,), None) == ()


def test_more_alternatives_than_the_cap_are_refused() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        prompt_logprobs(np.zeros((1, 4), np.float32), (1,), 21)


def _executor(tinylm: LoadedModel) -> StepExecutor:
    ticks = itertools.count()
    return StepExecutor(tinylm.generator, 32, 8, clock=lambda: float(next(ticks)), seed_source=lambda: 99)


def _chunked_prefill(executor: StepExecutor, chunk: int, k: int) -> list[SequenceOutput]:
    outputs = []
    num_blocks = 0
    for start in range(0, len(PROMPT), chunk):
        end = min(start + chunk, len(PROMPT))
        new = tuple(range(num_blocks, -(-end // 8)))  # block size 8: the blocks up to `end` not yet given
        num_blocks += len(new)
        step = SequenceStep(1, PROMPT[start:end], start, new, reset_block_table=start == 0, sample=end == len(PROMPT),
                            sampling=SamplingParams(), prompt_logprobs=k,
                            next_prompt_token_id=PROMPT[end] if end < len(PROMPT) else None)
        result, _ = executor.run(RunStep(start, (step,)))
        assert result[0].error is None, result[0].error
        outputs.append(result[0])
    return outputs


@pytest.mark.parametrize("chunk", [len(PROMPT), 8, 5])
def test_chunked_prefill_reports_the_dense_forwards_log_softmax(tinylm: LoadedModel, chunk: int) -> None:
    outputs = _chunked_prefill(_executor(tinylm), chunk, k=3)
    reported = [p for out in outputs for p in out.prompt_logprobs]
    assert [p.token.token_id for p in reported] == list(PROMPT[1:])
    reference = torch.log_softmax(tinylm.generator.dense_logits(PROMPT).double(), dim=-1).numpy()
    for position, entry in enumerate(reported, start=1):
        row = reference[position - 1]
        assert entry.token.logprob == pytest.approx(row[PROMPT[position]], abs=ATOL)
        assert [t.logprob for t in entry.top] == pytest.approx(sorted(row, reverse=True)[:3], abs=ATOL)
    # The last chunk still samples the first token, as a prefill without prompt logprobs does.
    assert outputs[-1].token_id == tinylm.generator.greedy_dense(PROMPT, 1)[0]


def test_prompt_logprobs_cap_is_checked_per_sequence(tinylm: LoadedModel) -> None:
    step = SequenceStep(1, PROMPT, 0, (0, 1, 2, 3), reset_block_table=True, sample=True, prompt_logprobs=21)
    result, _ = _executor(tinylm).run(RunStep(1, (step,)))
    assert result[0].error is not None and result[0].error.code is ErrorCode.INVALID_ARGUMENT
    assert "prompt_logprobs must be in [0, 20]" in result[0].error.message


def test_prompt_logprobs_travel_on_the_wire_even_from_a_step_that_did_not_sample() -> None:
    command = scheduler_pb2.RunStep(step_id=1, seqs=[scheduler_pb2.SequenceStep(
        seq_id=1, token_ids=[5, 6], prompt_logprobs=2, next_prompt_token_id=7)])
    step = run_step_from_proto(command).seqs[0]
    assert (step.prompt_logprobs, step.next_prompt_token_id) == (2, 7)
    assert run_step_from_proto(scheduler_pb2.RunStep(seqs=[scheduler_pb2.SequenceStep(seq_id=1)])).seqs[0] \
        .prompt_logprobs is None
    entry = PositionLogprobs(TokenLogprob(6, -1.5), (TokenLogprob(9, -0.5),))
    result = step_result_to_proto(1, [SequenceOutput(1, prompt_logprobs=(entry, entry))], common_pb2.Timings())
    assert len(result.outputs) == 1 and len(result.outputs[0].prompt_logprobs) == 2
    assert result.outputs[0].prompt_logprobs[0].top[0].token_id == 9
