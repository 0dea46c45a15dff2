"""Attach messages: protobuf <-> the scheduler's domain types (attach_types.py), both ways.

The only place the Attach stream's protobuf meets the scheduler's logic, besides the session
(attach_session.py) that reads and writes it. Every step of every generator worker passes
through `encode_run_step`, so it builds in place and sets only fields that differ from their
defaults (costs measured in the comments).
"""

from __future__ import annotations

from collections.abc import Mapping

from infermesh.v1 import common_pb2, scheduler_pb2
from services.common import errors
from services.common.grammar_after_reasoning import GrammarAfterReasoning
from services.common.logprobs import PositionLogprobs, TokenLogprob
from services.common.status import ERROR_BY_STATUS, STATUS_BY_NUMBER
from services.common.timings import StageTime
from services.scheduler.attach_types import (
    AbortCommand,
    BatchCommand,
    BatchOutcome,
    Command,
    DrainCommand,
    EmbeddingInfo,
    ItemOutcome,
    Label,
    ModelKey,
    ModelKind,
    StepCommand,
    StepOutcome,
    StepsCommand,
    StepSequenceContext,
    WorkerCapacity,
    WorkerHello,
)
from services.scheduler.sequence import SamplingParams
from services.scheduler.step_plan import SequenceStep, StepPlan
from services.scheduler.tokenizer_spec import TokenizerKind, TokenizerSpec
from services.scheduler.worker_features import WorkerFeature

_KIND_FROM_WIRE = {
    common_pb2.MODEL_KIND_CLASSIFIER: ModelKind.CLASSIFIER,
    common_pb2.MODEL_KIND_GENERATOR: ModelKind.GENERATOR,
    # Scheduled as classifiers are (dynamic batching); the hello's tensor signature tells them apart.
    common_pb2.MODEL_KIND_TENSOR: ModelKind.CLASSIFIER,
    # Scheduled as generators are (continuous batching); the hello's embedding spec tells them apart.
    common_pb2.MODEL_KIND_EMBEDDING: ModelKind.GENERATOR,
}
KIND_TO_WIRE = {ModelKind.CLASSIFIER: common_pb2.MODEL_KIND_CLASSIFIER,
                ModelKind.GENERATOR: common_pb2.MODEL_KIND_GENERATOR}
_TOKENIZER_KIND_FROM_WIRE = {
    scheduler_pb2.TOKENIZER_KIND_UNSPECIFIED: TokenizerKind.BYTES,  # workers before the kind was read
    scheduler_pb2.TOKENIZER_KIND_BYTES: TokenizerKind.BYTES,
    scheduler_pb2.TOKENIZER_KIND_HF: TokenizerKind.HF,
}
# A value this scheduler does not know (a newer worker's) is skipped: it is never asked for.
_FEATURE_FROM_WIRE = {
    scheduler_pb2.WORKER_FEATURE_STRUCTURED_OUTPUT: WorkerFeature.STRUCTURED_OUTPUT,
    scheduler_pb2.WORKER_FEATURE_GRAMMAR_AFTER_REASONING: WorkerFeature.GRAMMAR_AFTER_REASONING,
}
_STAGE_NAMES = {
    value: name.removeprefix("STAGE_").lower()
    for name, value in common_pb2.Stage.items()
    if value != common_pb2.STAGE_UNSPECIFIED
}


# -- worker -> scheduler -----------------------------------------------------


def decode_hello(hello: scheduler_pb2.WorkerHello) -> WorkerHello:
    """The hello as declared (an unknown kind is None); attach_session.check_hello judges it."""
    capacity = hello.capacity
    tokenizer = hello.tokenizer
    return WorkerHello(
        worker_id=hello.worker_id,
        model=ModelKey(hello.model.name, hello.model.version),
        kind=_KIND_FROM_WIRE.get(hello.kind),
        capacity=WorkerCapacity(
            max_batch_size=capacity.max_batch_size,
            num_kv_blocks=capacity.num_kv_blocks,
            block_size=capacity.block_size,
            max_seq_len=capacity.max_seq_len,
            max_num_seqs=capacity.max_num_seqs,
            max_num_batched_tokens=capacity.max_num_batched_tokens,
            max_steps_in_flight=capacity.max_steps_in_flight,
            max_steps_per_command=capacity.max_steps_per_command,
            warm_batch_time_s=capacity.warm_batch_time_us / 1e6,
        ),
        protocol_version=hello.protocol_version,
        labels=tuple(hello.labels),
        tokenizer=decode_tokenizer_spec(tokenizer),
        input_height=hello.input_height,
        input_width=hello.input_width,
        tensor_inputs=tuple(hello.tensor_inputs),
        tensor_outputs=tuple(hello.tensor_outputs),
        preferred_batch_sizes=tuple(hello.preferred_batch_sizes),
        sampling_defaults=tuple((f.name, value) for f, value in hello.sampling_defaults.ListFields()),
        features=frozenset(_FEATURE_FROM_WIRE[f] for f in hello.features if f in _FEATURE_FROM_WIRE),
        embedding=EmbeddingInfo(hello.embedding.dimensions, hello.embedding.normalize, hello.embedding.matryoshka,
                                hello.embedding.pooling) if hello.kind == common_pb2.MODEL_KIND_EMBEDDING else None,
        lora_adapters=tuple(hello.lora_adapters),
    )


def decode_tokenizer_spec(spec: scheduler_pb2.TokenizerSpec) -> TokenizerSpec:
    return TokenizerSpec(
        vocab_size=spec.vocab_size,
        eos_token_id=spec.eos_token_id,
        bos_token_id=spec.bos_token_id,
        kind=_TOKENIZER_KIND_FROM_WIRE.get(spec.kind),
        tokenizer_json_sha256=spec.tokenizer_json_sha256,
        tokenizer_json_size_bytes=spec.tokenizer_json_size_bytes,
        add_bos_token=spec.add_bos_token if spec.HasField("add_bos_token") else None,
        add_eos_token=spec.add_eos_token if spec.HasField("add_eos_token") else None,
        special_tokens=tuple(sorted(spec.special_tokens.items())),
        chat_template=spec.chat_template,
        stop_token_ids=tuple(spec.stop_token_ids),
        tool_call_parser=spec.tool_call_parser,
        reasoning_parser=spec.reasoning_parser,
    )


def decode_step_result(result: scheduler_pb2.StepResult) -> StepOutcome:
    token_ids: dict[int, int] = {}
    failures: dict[int, errors.InfermeshError] = {}
    logprobs: dict[int, PositionLogprobs] = {}
    prompt_logprobs: dict[int, tuple[PositionLogprobs, ...]] = {}
    embeddings: dict[int, tuple[float, ...]] = {}
    for out in result.outputs:
        if out.HasField("error") and out.error.code != 0:
            failures[out.seq_id] = _item_error(out.error)
        else:
            token_ids[out.seq_id] = out.token_id
            if out.HasField("logprobs"):
                logprobs[out.seq_id] = decode_logprobs(out.logprobs)
            if out.prompt_logprobs:
                prompt_logprobs[out.seq_id] = tuple(decode_logprobs(p) for p in out.prompt_logprobs)
            if out.embedding:
                embeddings[out.seq_id] = tuple(out.embedding)
    return StepOutcome(token_ids, failures, result.timings.total_us / 1e6, logprobs, prompt_logprobs, embeddings)


def decode_logprobs(logprobs: common_pb2.PositionLogprobs) -> PositionLogprobs:
    return PositionLogprobs(TokenLogprob(logprobs.token.token_id, logprobs.token.logprob),
                            tuple(TokenLogprob(t.token_id, t.logprob) for t in logprobs.top))


def decode_batch_result(result: scheduler_pb2.BatchResult) -> BatchOutcome:
    items: dict[int, ItemOutcome] = {}
    for item in result.items:
        if item.HasField("error") and item.error.code != 0:
            items[item.item_id] = ItemOutcome(error=_item_error(item.error))
        else:
            items[item.item_id] = ItemOutcome(
                labels=tuple(Label(label.label, label.index, label.score) for label in item.labels),
                outputs=tuple(item.outputs))
    stages = tuple(StageTime(_STAGE_NAMES[s.stage], s.duration_us, s.service)
                   for s in result.timings.stages if s.stage in _STAGE_NAMES)
    return BatchOutcome(items, stages, result.timings.total_us)


def _item_error(error: scheduler_pb2.ItemError) -> errors.InfermeshError:
    code = STATUS_BY_NUMBER.get(error.code)
    cls = ERROR_BY_STATUS.get(code, errors.Internal) if code is not None else errors.Internal
    return cls(error.message)


# -- scheduler -> worker -----------------------------------------------------


def welcome(scheduler_id: str, heartbeat_interval_ms: int) -> scheduler_pb2.SchedulerCommand:
    return scheduler_pb2.SchedulerCommand(welcome=scheduler_pb2.Welcome(
        scheduler_id=scheduler_id, heartbeat_interval_ms=heartbeat_interval_ms))


def encode_command(command: Command) -> scheduler_pb2.SchedulerCommand:
    if isinstance(command, StepCommand):
        return scheduler_pb2.SchedulerCommand(run_step=encode_run_step(command.plan, command.sequences))
    if isinstance(command, StepsCommand):
        message = scheduler_pb2.SchedulerCommand()
        add = message.run_steps.steps.add
        for plan in command.plans:
            _fill_run_step(add(), plan, command.sequences)
        return message
    if isinstance(command, BatchCommand):
        return scheduler_pb2.SchedulerCommand(execute_batch=encode_execute_batch(command))
    if isinstance(command, AbortCommand):
        return scheduler_pb2.SchedulerCommand(abort=scheduler_pb2.Abort(seq_ids=command.seq_ids))
    if isinstance(command, DrainCommand):
        return scheduler_pb2.SchedulerCommand(drain=scheduler_pb2.Drain(grace_ms=command.grace_ms))
    raise TypeError(f"not an Attach command: {command!r}")


def encode_execute_batch(batch: BatchCommand) -> scheduler_pb2.ExecuteBatch:
    command = scheduler_pb2.ExecuteBatch(batch_id=batch.batch_id)
    add = command.items.add  # add() builds in place; append() would copy each item (and its image)
    for item in batch.items:
        add(item_id=item.item_id, image=item.image, top_k=item.top_k, trace_context=item.trace_context,
            deadline_unix_us=_unix_us(item.deadline_unix_s), inputs=item.inputs)
    if batch.deadline_unix_s is not None:
        command.deadline_unix_us = _unix_us(batch.deadline_unix_s)
    return command


def encode_run_step(plan: StepPlan, sequences: Mapping[int, StepSequenceContext]) -> scheduler_pb2.RunStep:
    """The step for the worker. Sampling carries what the worker samples with (temperature, top_p,
    seed); a sequence whose stream is gone gets neither sampling nor trace context."""
    return _fill_run_step(scheduler_pb2.RunStep(), plan, sequences)


def _fill_run_step(command: scheduler_pb2.RunStep, plan: StepPlan,
                   sequences: Mapping[int, StepSequenceContext]) -> scheduler_pb2.RunStep:
    command.step_id = plan.step_id
    if plan.finished_seq_ids:
        command.finished_seq_ids.extend(plan.finished_seq_ids)
    add = command.seqs.add  # add() builds in place; append() would copy each step
    for step in plan.seqs:
        context = sequences.get(step.seq_id)
        # Fields a decode step leaves at their defaults are set only when present: passing an empty
        # list, False or None to add() still costs about half of the call (1.6 us of 3.1).
        seq = add(
            seq_id=step.seq_id,
            token_ids=step.token_ids,
            start_position=step.start_position,
            sample=step.sample,
            num_generated=step.num_generated,
        )
        if context is not None:
            # Three field writes cost no more than CopyFrom() of a prepared message (31 vs 33 us at 32
            # sequences), and need no protobuf kept beside the sequence.
            sampling = seq.sampling
            sampling.seed = context.seed
            if step.sampling.temperature:
                sampling.temperature = step.sampling.temperature
            if step.sampling.top_p != 1.0:
                sampling.top_p = step.sampling.top_p
            if step.sampling.top_k:
                sampling.top_k = step.sampling.top_k
            if step.sampling.min_p:
                sampling.min_p = step.sampling.min_p
            if step.sampling.logprobs:
                sampling.logprobs = True
                sampling.top_logprobs = step.sampling.top_logprobs
            if step.sampling.penalized or step.sampling.logit_bias:
                _fill_penalties(sampling, step.sampling)
            if step.sampling.grammar:
                seq.grammar = step.sampling.grammar
                if step.sampling.grammar_after_reasoning is not None:
                    _fill_grammar_after(seq.grammar_after_reasoning, step.sampling.grammar_after_reasoning)
            if step.sampling.min_tokens_ban and step.sample and step.num_generated < step.sampling.min_tokens:
                seq.banned_token_ids.extend(step.sampling.min_tokens_ban)
            if step.banned_token_ids:
                seq.banned_token_ids.extend(step.banned_token_ids)
            if step.sampling.allowed_token_ids:
                sampling.allowed_token_ids.extend(step.sampling.allowed_token_ids)
            if step.prompt_logprobs is not None:
                seq.prompt_logprobs = step.prompt_logprobs
                if step.next_prompt_token_id is not None:
                    seq.next_prompt_token_id = step.next_prompt_token_id
            if context.trace_context and _traced(step):
                seq.trace_context.update(context.trace_context)
        if step.sampling.lora_adapter:
            seq.lora_adapter = step.sampling.lora_adapter
        if step.input_from_last_sample:
            seq.input_from_last_sample = True
        if step.new_blocks:
            seq.new_blocks.extend(step.new_blocks)
        if step.reset_block_table:
            seq.reset_block_table = True
            if step.num_cached_tokens:
                seq.num_cached_tokens = step.num_cached_tokens
            if step.context_token_ids:
                seq.context_token_ids.extend(step.context_token_ids)
    return command


def _fill_penalties(sampling: common_pb2.SamplingParams, params: SamplingParams) -> None:
    sampling.presence_penalty = params.presence_penalty
    sampling.frequency_penalty = params.frequency_penalty
    if params.repetition_penalty != 1.0:
        sampling.repetition_penalty = params.repetition_penalty
    if params.logit_bias:
        sampling.logit_bias.update(params.logit_bias)


def _fill_grammar_after(field: scheduler_pb2.GrammarAfterReasoning, after: GrammarAfterReasoning) -> None:
    field.end_token_id = after.end_token_id
    if after.start_token_id is not None:
        field.start_token_id = after.start_token_id


def _traced(step: SequenceStep) -> bool:
    """Whether the worker records spans for this step under the request's trace: prompt chunks and
    recomputes (a sequence's first step, even one token after a cached prefix), not every
    single-token decode (at 32 sequences that is 32 traces touched per step, about a millisecond of
    the worker's event loop)."""
    return step.reset_block_table or step.start_position == 0 or len(step.token_ids) > 1


def _unix_us(unix_s: float | None) -> int:
    return 0 if unix_s is None else int(unix_s * 1e6)
