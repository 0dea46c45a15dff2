"""The Scheduler service's call messages (Classify, Generate, Submit entries, GetPressure,
ListModels): protobuf <-> the scheduler's domain types. Used by servicer.py only."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2
from services.common import errors
from services.common.generate_input import check_input
from services.common.logprobs import MAX_TOP_LOGPROBS
from services.common.model_default_fields import MODEL_DEFAULT_FIELDS
from services.common.priority import Priority
from services.common.sampling_bounds import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BIAS,
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_K,
)
from services.common.timings import StageTime, seconds_to_us
from services.scheduler.attach_codec import KIND_TO_WIRE
from services.scheduler.attach_types import Label, ModelKey
from services.scheduler.bad_words import BadWordRefused, BadWords, tokenize_bad_words
from services.scheduler.fair_queue import TenantContext
from services.scheduler.model_text import ChatRendering, ModelText
from services.scheduler.pressure import ModelPressure
from services.scheduler.sequence import FinishReason, SamplingParams, ending_token_ids
from services.scheduler.structured_output import compile_grammar

# Requests that carry no tenant (direct calls, tests) share one queue.
ANONYMOUS_TENANT = "anonymous"
FINISH_REASONS = {
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.EOS: common_pb2.FINISH_REASON_EOS,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
}
_STAGES = {
    name.removeprefix("STAGE_").lower(): value
    for name, value in common_pb2.Stage.items()
    if value != common_pb2.STAGE_UNSPECIFIED
}
_KNOWN_PRIORITIES = frozenset(common_pb2.Priority.values())
_MAX_REMEMBERED_TENANTS = 10_000
# Every generated token is searched for every stop string on the scheduler's event loop, so the
# list is bounded: 400 000 stop strings once stalled the loop (24 ms a token) for every stream on it.
# OpenAI allows 4; vLLM and SGLang users pass a handful.
MAX_STOP_SEQUENCES = 16
MAX_STOP_BYTES = 256


class TenantCodec:
    """TenantContext messages -> domain tenants, remembered: the same few tenants arrive with every
    request, and building one costs more than the lookup."""

    def __init__(self) -> None:
        self._tenants: dict[tuple[str, int, int], TenantContext] = {}

    def decode(self, context: scheduler_pb2.TenantContext) -> TenantContext:
        key = (context.tenant_id, context.priority, context.weight)
        tenant = self._tenants.get(key)
        if tenant is not None:
            return tenant
        if context.priority not in _KNOWN_PRIORITIES:
            raise errors.InvalidArgument(f"tenant.priority {context.priority} is not a known Priority")
        tenant = TenantContext(context.tenant_id or ANONYMOUS_TENANT, Priority.from_wire(context.priority),
                               max(1, context.weight))
        if len(self._tenants) >= _MAX_REMEMBERED_TENANTS:
            self._tenants.clear()  # tenants come from the gateway's config; this only bounds a misbehaving caller
        self._tenants[key] = tenant
        return tenant


def prompt_token_ids(request: gateway_pb2.GenerateRequest, text: ModelText) -> tuple[int, ...]:
    """The request's prompt tokens, tokenized once: its prompt, its prompt_token_ids as they are (no
    BOS added, as vLLM takes token prompts), or its messages rendered with the model's chat template
    (a resumed stream's too: the same conversation renders the same ids)."""
    check_input(request.prompt, request.messages, request.tools, request.prompt_token_ids)
    rendering = chat_rendering(request)
    if request.prompt_token_ids:
        return known_token_ids(request.prompt_token_ids, text.tokenizer.vocab_size, "prompt_token_ids")
    if request.prompt:
        special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        return text.tokenizer.encode(request.prompt, add_special_tokens=special)
    if request.HasField("add_special_tokens"):
        rendering = dataclasses.replace(rendering, add_special_tokens=request.add_special_tokens)
    return text.chat_prompt_ids([chat_turn(m) for m in request.messages], [template_tool(t) for t in request.tools],
                                rendering)


def truncated_prompt(prompt_ids: tuple[int, ...], request: gateway_pb2.GenerateRequest,
                     max_seq_len: int) -> tuple[int, ...]:
    """vLLM's truncate_prompt_tokens: the prompt's last N tokens (-1: the model's context)."""
    if not request.HasField("truncate_prompt_tokens"):
        return prompt_ids
    keep = max_seq_len if request.truncate_prompt_tokens == -1 else request.truncate_prompt_tokens
    if not 1 <= keep <= max_seq_len:
        raise errors.InvalidArgument(f"truncate_prompt_tokens must be -1 (the model's context) or in [1, "
                                     f"{max_seq_len}] (the model's context), got {request.truncate_prompt_tokens}")
    return prompt_ids[-keep:]


# Template variables a request sets itself, which chat_template_kwargs may not (transformers refuses them too).
_RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")
MAX_TEMPLATE_KWARGS_BYTES = 64 * 1024
_DEFAULT_RENDERING = ChatRendering()


def chat_rendering(request: gateway_pb2.GenerateRequest | gateway_pb2.TokenizeRequest) -> ChatRendering:
    """vLLM's chat options of a Generate or Tokenize request, checked (only with messages)."""
    if not (request.continue_final_message or request.chat_template_kwargs or request.HasField("add_generation_prompt")):
        return _DEFAULT_RENDERING  # every request sending none: no parsing, no object
    generation = request.add_generation_prompt if request.HasField("add_generation_prompt") else True
    if generation and request.continue_final_message:
        raise errors.InvalidArgument("continue_final_message leaves the final message open, so it cannot be "
                                     "combined with add_generation_prompt true (set it false)")
    rendering = ChatRendering(generation, request.continue_final_message,
                              _template_variables(request.chat_template_kwargs))
    if not request.messages and (rendering != _DEFAULT_RENDERING or request.chat_template_kwargs):
        raise errors.InvalidArgument("add_generation_prompt, continue_final_message and chat_template_kwargs "
                                     "shape how messages render: send them with messages, not a prompt")
    return rendering


def _template_variables(text: str) -> dict[str, Any]:
    if not text:
        return {}
    if len(text.encode()) > MAX_TEMPLATE_KWARGS_BYTES:
        raise errors.InvalidArgument(f"chat_template_kwargs holds {len(text.encode())} bytes; at most "
                                     f"{MAX_TEMPLATE_KWARGS_BYTES} are allowed")
    try:
        variables = json.loads(text)
    except ValueError as exc:
        raise errors.InvalidArgument(f"chat_template_kwargs must be a JSON object: {exc}") from None
    if not isinstance(variables, dict):
        raise errors.InvalidArgument(f"chat_template_kwargs must be a JSON object, got {type(variables).__name__}")
    reserved = [name for name in _RESERVED_TEMPLATE_VARIABLES if name in variables]
    if reserved:
        raise errors.InvalidArgument(f"chat_template_kwargs.{reserved[0]}: set by the request itself, not a "
                                     "template variable it may pass")
    return variables


def known_token_ids(token_ids: Sequence[int], vocab_size: int, field: str) -> tuple[int, ...]:
    """`token_ids` (a request's `field`), each below the model's vocab_size, else InvalidArgument naming the first."""
    ids = tuple(token_ids)
    if ids and max(ids) >= vocab_size:
        index = next(i for i, token_id in enumerate(ids) if token_id >= vocab_size)
        raise errors.InvalidArgument(f"{field}[{index}] is {ids[index]}, but the model's token ids are "
                                     f"0..{vocab_size - 1} (vocab_size {vocab_size})")
    return ids


def chat_turn(message: gateway_pb2.ChatMessage) -> dict[str, Any]:
    """A turn as the template sees it: OpenAI's message shape, as transformers' apply_chat_template
    takes it (a call's arguments parsed, as vLLM passes them: templates write them with tojson)."""
    turn: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        turn["tool_calls"] = [{"id": call.id, "type": "function",
                               "function": {"name": call.name, "arguments": _json_object_or_text(call.arguments)}}
                              for call in message.tool_calls]
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    if message.name:
        turn["name"] = message.name
    return turn


def template_tool(tool: gateway_pb2.Tool) -> dict[str, Any]:
    """A tool as the template's `tools` holds it (OpenAI's shape; check_input checked the schema)."""
    function: dict[str, Any] = {"name": tool.name, "description": tool.description}
    if tool.parameters:
        function["parameters"] = json.loads(tool.parameters)
    return {"type": "function", "function": function}


def _json_object_or_text(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def prediction_factor(factor: float) -> float:
    """ScheduleGenerateRequest.ttft_prediction_factor as the pool judges with it: 0 (unset) is 1."""
    if not math.isfinite(factor) or factor < 0:
        raise errors.InvalidArgument(f"ttft_prediction_factor must be a finite number >= 0 (0: 1), got {factor}")
    return factor or 1.0


def with_model_defaults(sampling: common_pb2.SamplingParams, default_fields: Iterable[common_pb2.SamplingField],
                        defaults: Iterable[tuple[str, float]]) -> common_pb2.SamplingParams:
    """`sampling` with each field the request left to the model (`default_fields`) set to the model's
    recommended value (`defaults`: its hello's) where it has one; the request's own value where it has
    none. A field value this scheduler does not know (a newer gateway's) is passed over."""
    recommended = dict(defaults)
    chosen = {name: recommended[name] for f in default_fields
              if (name := MODEL_DEFAULT_FIELDS.get(f)) is not None and name in recommended}
    if not chosen:
        return sampling
    out = common_pb2.SamplingParams()
    out.CopyFrom(sampling)
    for name, value in chosen.items():
        setattr(out, name, value)
    return out


def decode_sampling(sampling: common_pb2.SamplingParams, max_tokens: int, vocab_size: int | None = None,
                    end_token_ids: Iterable[int] = (),
                    encode: Callable[[str], Sequence[int]] | None = None) -> SamplingParams:
    """`max_tokens`: the request's, or the default the servicer chose. `vocab_size`: the model's,
    which every logit_bias token id must be below (None: not checked). `end_token_ids`: the model's
    (Tokenizer.end_token_ids), which min_tokens holds off. `encode`: the model's tokenizer without
    special tokens, for bad_words (None: bad_words is refused)."""
    if not (math.isfinite(sampling.temperature) and sampling.temperature >= 0):  # NaN passes a plain < 0
        raise errors.InvalidArgument(f"sampling.temperature must be a finite number >= 0, got {sampling.temperature}")
    if not 0 <= sampling.top_p <= 1:
        raise errors.InvalidArgument(f"sampling.top_p must be in [0, 1], got {sampling.top_p}")
    _check_stops(sampling.stop)
    if sampling.top_logprobs > MAX_TOP_LOGPROBS:
        raise errors.InvalidArgument(f"sampling.top_logprobs must be at most {MAX_TOP_LOGPROBS}, "
                                     f"got {sampling.top_logprobs}")
    if sampling.top_logprobs and not sampling.logprobs:
        raise errors.InvalidArgument("sampling.top_logprobs needs sampling.logprobs")
    if sampling.HasField("prompt_logprobs") and sampling.prompt_logprobs > MAX_TOP_LOGPROBS:
        raise errors.InvalidArgument(f"sampling.prompt_logprobs must be at most {MAX_TOP_LOGPROBS}, "
                                     f"got {sampling.prompt_logprobs}")
    _check_penalties(sampling)
    _check_cuts(sampling)
    _check_logit_bias(sampling.logit_bias, vocab_size)
    if sampling.HasField("structured") and sampling.ignore_eos:
        # A complete grammar allows only the end: generating past it has nothing left to sample.
        raise errors.InvalidArgument("sampling.ignore_eos cannot be combined with sampling.structured")
    stop_token_ids = _stop_token_ids(sampling.stop_token_ids, vocab_size)
    if sampling.min_tokens > max_tokens:
        asked = "max_tokens" if sampling.max_tokens else "the default max_tokens"
        raise errors.InvalidArgument(f"sampling.min_tokens ({sampling.min_tokens}) must be at most {asked} "
                                     f"({max_tokens})")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p or 1.0,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop=tuple(sampling.stop),
        ignore_eos=sampling.ignore_eos,
        logprobs=sampling.logprobs,
        top_logprobs=sampling.top_logprobs,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty or 1.0,
        logit_bias=tuple(sorted(sampling.logit_bias.items())),
        grammar=_grammar(sampling.structured) if sampling.HasField("structured") else "",
        prompt_logprobs=sampling.prompt_logprobs if sampling.HasField("prompt_logprobs") else None,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        min_tokens=sampling.min_tokens,
        min_tokens_ban=tuple(sorted(ending_token_ids(end_token_ids, sampling.ignore_eos, stop_token_ids)))
        if sampling.min_tokens else (),
        stop_token_ids=stop_token_ids,
        include_stop_str_in_output=sampling.include_stop_str_in_output,
        allowed_token_ids=_allowed_token_ids(sampling.allowed_token_ids, vocab_size),
        bad_words=_bad_words(sampling.bad_words, encode, vocab_size),
    )


def _allowed_token_ids(token_ids: Sequence[int], vocab_size: int | None) -> tuple[int, ...]:
    if len(token_ids) > MAX_ALLOWED_TOKEN_IDS:
        raise errors.InvalidArgument(f"sampling.allowed_token_ids holds {len(token_ids)} ids; at most "
                                     f"{MAX_ALLOWED_TOKEN_IDS} are allowed")
    if vocab_size is not None:
        known_token_ids(token_ids, vocab_size, "sampling.allowed_token_ids")
    return tuple(sorted(set(token_ids)))


def _bad_words(words: Sequence[str], encode: Callable[[str], Sequence[int]] | None,
               vocab_size: int | None) -> BadWords | None:
    if not words:
        return None
    if encode is None or vocab_size is None:
        raise errors.InvalidArgument("sampling.bad_words needs the model's tokenizer, which this call has not")
    try:
        return tokenize_bad_words(list(words), encode, vocab_size, "sampling.bad_words")
    except BadWordRefused as exc:
        raise errors.InvalidArgument(str(exc)) from None


def _grammar(structured: common_pb2.StructuredOutput) -> str:
    kind = structured.WhichOneof("kind")
    if kind is None:
        raise errors.InvalidArgument("sampling.structured: set one of json_schema, json_object, regex, choice, grammar")
    if kind == "choice":
        return compile_grammar(kind, list(structured.choice.choices))
    if kind == "json_object":
        return compile_grammar(kind, "")
    return compile_grammar(kind, getattr(structured, kind))


def _check_penalties(sampling: common_pb2.SamplingParams) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(sampling, name)
        if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
            raise errors.InvalidArgument(f"sampling.{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
    value = sampling.repetition_penalty
    if not (math.isfinite(value) and 0 <= value <= MAX_PENALTY):
        raise errors.InvalidArgument(f"sampling.repetition_penalty must be in (0, {MAX_PENALTY:g}] (0: off), got {value}")


def _check_cuts(sampling: common_pb2.SamplingParams) -> None:
    if sampling.top_k > MAX_TOP_K:
        raise errors.InvalidArgument(f"sampling.top_k must be at most {MAX_TOP_K} (0: off), got {sampling.top_k}")
    if not (math.isfinite(sampling.min_p) and 0 <= sampling.min_p <= 1):
        raise errors.InvalidArgument(f"sampling.min_p must be in [0, 1] (0: off), got {sampling.min_p}")


def _check_logit_bias(logit_bias: Mapping[int, float], vocab_size: int | None) -> None:
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise errors.InvalidArgument(f"sampling.logit_bias holds {len(logit_bias)} entries; at most "
                                     f"{MAX_LOGIT_BIAS} are allowed")
    for token_id, bias in logit_bias.items():
        if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
            ids = f"0..{vocab_size - 1}" if vocab_size is not None else ">= 0"
            raise errors.InvalidArgument(f"sampling.logit_bias: token id {token_id} is not a token of this model "
                                         f"(ids {ids})")
        if not (math.isfinite(bias) and -MAX_BIAS <= bias <= MAX_BIAS):
            raise errors.InvalidArgument(f"sampling.logit_bias[{token_id}] must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], "
                                         f"got {bias}")


def _stop_token_ids(token_ids: Sequence[int], vocab_size: int | None) -> frozenset[int]:
    if len(token_ids) > MAX_STOP_TOKEN_IDS:
        raise errors.InvalidArgument(f"sampling.stop_token_ids holds {len(token_ids)} ids; at most "
                                     f"{MAX_STOP_TOKEN_IDS} are allowed")
    if vocab_size is not None:
        known_token_ids(token_ids, vocab_size, "sampling.stop_token_ids")
    return frozenset(token_ids)


def _check_stops(stops) -> None:
    if len(stops) > MAX_STOP_SEQUENCES:
        raise errors.InvalidArgument(f"sampling.stop holds {len(stops)} strings; at most {MAX_STOP_SEQUENCES} are allowed")
    for stop in stops:
        if not stop:
            raise errors.InvalidArgument("sampling.stop must not contain empty strings")
        if len(stop.encode("utf-8")) > MAX_STOP_BYTES:
            raise errors.InvalidArgument(f"sampling.stop strings must be at most {MAX_STOP_BYTES} bytes (UTF-8), "
                                         f"got one of {len(stop.encode('utf-8'))}")


def encode_pressure(key: ModelKey, pressure: ModelPressure) -> common_pb2.ModelPressure:
    return common_pb2.ModelPressure(
        model=common_pb2.ModelRef(name=key.name, version=key.version),
        est_queue_time_us=pressure.est_queue_time_us_by_priority(),
        queue_depth=pressure.queue_depth,
        kv_usage=pressure.kv_usage,
        num_workers=pressure.num_workers,
        min_service_time_us=seconds_to_us(pressure.min_service_time_s),
        num_slots=pressure.num_slots,
        predicted_ttft_us=pressure.predicted_ttft_us_by_priority(),
        min_ttft_us=seconds_to_us(pressure.min_ttft_s),
        ttft_per_queued_us=pressure.ttft_per_queued_us_by_priority(),
        ttft_per_prompt_token_ns=round(min(pressure.ttft_per_prompt_token_s, 1.0) * 1e9),
    )


def add_labels(response: gateway_pb2.ClassifyResponse, labels: tuple[Label, ...]) -> None:
    add = response.labels.add
    for label in labels:
        add(label=label.label, index=label.index, score=label.score)


def add_stages(timings: common_pb2.Timings, stages: tuple[StageTime, ...]) -> None:
    add = timings.stages.add
    for stage in stages:
        add(stage=_STAGES[stage.stage], duration_us=stage.duration_us, service=stage.service)


__all__ = ["ANONYMOUS_TENANT", "FINISH_REASONS", "KIND_TO_WIRE", "MAX_STOP_BYTES", "MAX_STOP_SEQUENCES", "TenantCodec", "add_labels", "add_stages",
           "chat_rendering", "decode_sampling", "truncated_prompt", "encode_pressure", "known_token_ids", "prompt_token_ids"]
