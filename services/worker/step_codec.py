"""RunStep / StepResult protobuf <-> the plain data of services/worker/work.py, for every generator runtime."""

from __future__ import annotations

from collections.abc import Iterable

from infermesh.v1 import common_pb2, scheduler_pb2
from services.common.grammar_after_reasoning import GrammarAfterReasoning
from services.worker import work


def item_error_to_proto(error: work.ItemError | None) -> scheduler_pb2.ItemError | None:
    return None if error is None else scheduler_pb2.ItemError(code=int(error.code), message=error.message)


# A sequence's sampling is the same message every step: each distinct one is decoded once. Keyed by its
# wire bytes (a seed alone is a few bytes); bounded, since seeds and requests never repeat for long.
_SAMPLING_CACHE: dict[bytes, work.SamplingParams] = {}
_SAMPLING_CACHE_SIZE = 4096


def sequence_step_from_proto(seq: scheduler_pb2.SequenceStep) -> work.SequenceStep:
    return work.SequenceStep(
        seq_id=seq.seq_id,
        token_ids=tuple(seq.token_ids),
        start_position=seq.start_position,
        new_blocks=tuple(seq.new_blocks),
        reset_block_table=seq.reset_block_table,
        sample=seq.sample,
        sampling=_sampling_of(seq),
        num_generated=seq.num_generated,
        num_cached_tokens=seq.num_cached_tokens,
        input_from_last_sample=seq.input_from_last_sample,
        context_token_ids=tuple(seq.context_token_ids),
        prompt_logprobs=seq.prompt_logprobs if seq.HasField("prompt_logprobs") else None,
        next_prompt_token_id=seq.next_prompt_token_id if seq.HasField("next_prompt_token_id") else None,
        banned_token_ids=tuple(seq.banned_token_ids),
        lora_adapter=seq.lora_adapter,
    )


def _sampling_of(seq: scheduler_pb2.SequenceStep) -> work.SamplingParams:
    if seq.grammar or seq.HasField("grammar_after_reasoning"):
        return _sampling_from_proto(seq)  # rare, and a grammar is no cheap key
    key = seq.sampling.SerializeToString()
    sampling = _SAMPLING_CACHE.get(key)
    if sampling is None:
        if len(_SAMPLING_CACHE) >= _SAMPLING_CACHE_SIZE:
            _SAMPLING_CACHE.clear()
        sampling = _SAMPLING_CACHE[key] = _sampling_from_proto(seq)
    return sampling


def _sampling_from_proto(seq: scheduler_pb2.SequenceStep) -> work.SamplingParams:
    sampling = seq.sampling
    return work.SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p or 1.0,
        seed=sampling.seed if sampling.HasField("seed") else None,
        logprobs=sampling.logprobs,
        top_logprobs=sampling.top_logprobs,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty or 1.0,
        logit_bias=tuple(sorted(sampling.logit_bias.items())),
        grammar=seq.grammar,
        grammar_after_reasoning=_grammar_after(seq) if seq.HasField("grammar_after_reasoning") else None,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        allowed_token_ids=tuple(sampling.allowed_token_ids),
    )


def _grammar_after(seq: scheduler_pb2.SequenceStep) -> GrammarAfterReasoning:
    after = seq.grammar_after_reasoning
    return GrammarAfterReasoning(after.end_token_id,
                                 after.start_token_id if after.HasField("start_token_id") else None)


def run_step_from_proto(command: scheduler_pb2.RunStep) -> work.RunStep:
    return work.RunStep(
        step_id=command.step_id,
        seqs=tuple(sequence_step_from_proto(seq) for seq in command.seqs),
        finished_seq_ids=tuple(command.finished_seq_ids),
    )


def logprobs_to_proto(logprobs: work.PositionLogprobs | None) -> common_pb2.PositionLogprobs | None:
    return None if logprobs is None else _position_to_proto(logprobs)


def _position_to_proto(logprobs: work.PositionLogprobs) -> common_pb2.PositionLogprobs:
    return common_pb2.PositionLogprobs(
        token=common_pb2.TokenLogprob(token_id=logprobs.token.token_id, logprob=logprobs.token.logprob),
        top=[common_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob) for t in logprobs.top],
    )


def step_result_to_proto(step_id: int, outputs: Iterable[work.SequenceOutput],
                         timings: common_pb2.Timings) -> scheduler_pb2.StepResult:
    """Sequences that only computed (no sample, no error, no prompt logprobs) send nothing back."""
    result = scheduler_pb2.StepResult(step_id=step_id, timings=timings)
    add = result.outputs.add  # in place, and only the fields an output has: an empty one passed costs too
    for out in outputs:
        if out.token_id is not None:
            message = add(seq_id=out.seq_id, token_id=out.token_id, logprob=out.logprob or 0.0)
        elif out.error is not None or out.prompt_logprobs or out.embedding:
            message = add(seq_id=out.seq_id)
        else:
            continue
        if out.error is not None:
            message.error.CopyFrom(item_error_to_proto(out.error))
        if out.logprobs is not None:
            message.logprobs.CopyFrom(_position_to_proto(out.logprobs))
        if out.prompt_logprobs:
            message.prompt_logprobs.extend(_position_to_proto(p) for p in out.prompt_logprobs)
        if out.embedding:
            message.embedding.extend(out.embedding)
    return result
