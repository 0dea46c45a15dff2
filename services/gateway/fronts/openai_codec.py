"""OpenAI's completions and chat completions JSON <-> infermesh GenerateRequest / GenerateResponse.

The only place the OpenAI wire shapes live: request validation (400 naming the parameter),
response objects, streaming chunks, and the error table from domain errors to HTTP status and
OpenAI's `{"error": {"message", "type", "param", "code"}}` body. Supported fields, and what each
unsupported one answers, are listed in docs/clients.md.

Chat goes upstream as its messages (GenerateRequest.messages, a content's text parts joined): the
scheduler renders the model's own chat template and tokenizes once (docs/ARCHITECTURE.md,
"Tokenization"). A model without a template answers 400.
"""

from __future__ import annotations

import dataclasses
import math
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from infermesh.v1 import common_pb2, gateway_pb2
from services.common import errors
from services.common.generate_input import CHAT_ROLES
from services.common.logprobs import MAX_TOP_LOGPROBS
from services.common.model_default_fields import MODEL_DEFAULT_FIELDS
from services.gateway.admission.latency_admission import ObjectiveMissed, ObjectiveUnmeetable, TpotUnmeetable
from services.gateway.fronts.http_status import HttpRefusal, http_refusal, matching
from services.gateway.fronts.openai_batch import Prompt, check_batch_size, completion_prompts, set_prompt
from services.gateway.fronts.openai_choices import MAX_CHOICES, ChoiceResult, chunk_token_ids
from services.gateway.fronts.openai_params import (
    BadParameter,
    boolean,
    chat_logprobs,
    chat_options,
    is_int,
    is_number,
    json_object,
    model_ref,
    number,
    penalties,
    shown,
    structured,
)
from services.gateway.fronts.openai_prompt import PromptOptions, prompt_options, vllm_prompt_logprobs
from services.gateway.fronts.openai_stored import ResponseNotFound
from services.gateway.fronts.openai_tools import add_turn_fields, parse_tools
from services.gateway.fronts.reasoning import (
    ReasoningSplitter,
    chat_message,
    reasoning_delta,
    split_reasoning,
)
from services.gateway.fronts.tool_calls import ChatTools, ToolCallSplitter
from services.gateway.quota.quotas import QuotaExceeded

MAX_STOP_SEQUENCES = 4
# MAX_TOP_LOGPROBS (OpenAI's top_logprobs limit) bounds completions' logprobs too: OpenAI's legacy 5
# would refuse what vLLM clients send.

# Far above any model's max_seq_len; the scheduler refuses what does not fit the model.
MAX_MAX_TOKENS = 1 << 20
COMPLETION = "text_completion"
CHAT = "chat.completion"

_FINISH_REASONS = {
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_EOS: "stop",
    common_pb2.FINISH_REASON_STOP: "stop",
}
_STAGE_NAMES = {value: name.removeprefix("STAGE_").lower() for name, value in common_pb2.Stage.items()}


@dataclass(frozen=True)
class OpenAIRequest:
    """A validated completions or chat completions request."""

    kind: str  # COMPLETION | CHAT
    model: str  # as the client named it, echoed in every response
    generate: gateway_pb2.GenerateRequest
    stream: bool
    include_usage: bool
    # Choices returned (n) and generated (best_of >= n; the n with the best mean logprob per token
    # are returned). best_of > n is never streamed.
    n: int = 1
    best_of: int = 1
    # What the client asked for: best_of > n asks the workers for logprobs to rank by, in any case.
    logprobs: bool = False
    # The parameter that asked for structured output (response_format, a guided_*, or tools for a
    # constrained tool_choice), if any.
    structured_param: str | None = None
    # Chat with tools: the tool choice (tool_calls.py); None: no tools offered.
    tools: ChatTools | None = None
    # echo and vLLM's prompt_logprobs (openai_prompt.py).
    prompt: PromptOptions = PromptOptions()
    # The name the client gave the output's length (chat: max_tokens or max_completion_tokens).
    max_tokens_param: str = "max_tokens"
    # Completions with a list of prompts: every prompt (generate holds the first); empty for one
    # (openai_batch.py).
    batch_prompts: tuple[Prompt, ...] = ()
    # vLLM's include_reasoning (chat): false leaves a reasoning model's reasoning out of the answer.
    include_reasoning: bool = True


# -- requests ---------------------------------------------------------------------------


def parse_completion(body: Any) -> OpenAIRequest:
    body = json_object(body)
    prompts = completion_prompts(body.get("prompt"))
    prompt = prompts[0]
    _refuse_unsupported(body)
    for name in ("tools", "tool_choice"):
        if not _is_default(body.get(name), (None, "none")):
            raise BadParameter(name, f"{name} is a chat parameter (/v1/chat/completions), got {shown(body[name])}")
    boolean(body, "parallel_tool_calls", True)  # checked as chat checks it; without tools it changes nothing
    options = prompt_options(body, completion=True)
    parsed = _request(COMPLETION, body, "", 1 if options.echo_only else _max_tokens(body, "max_tokens"))
    set_prompt(parsed.generate, prompt)
    sampling = parsed.generate.sampling
    _completion_logprobs(body, sampling)
    upstream = options.upstream(sampling.top_logprobs if sampling.logprobs else None)
    if upstream is None and options.echo and not all(isinstance(p, str) for p in prompts):
        upstream = 0  # a token prompt's echo is spelled from its tokens, which the prompt's logprobs carry
    if upstream is not None:
        sampling.prompt_logprobs = upstream
    parsed = _ends_with_its_structure(_with_choices(dataclasses.replace(parsed, prompt=options), body))
    if len(prompts) == 1:
        return parsed
    check_batch_size(len(prompts), parsed.best_of)
    if not parsed.generate.request_id:
        parsed.generate.request_id = uuid.uuid4().hex  # each prompt's is <this>-p<k>
    return dataclasses.replace(parsed, batch_prompts=prompts)


def parse_chat(body: Any) -> OpenAIRequest:
    body = json_object(body)
    messages = chat_messages(body.get("messages"))
    _refuse_unsupported(body)
    options = prompt_options(body, completion=False)
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    parsed = dataclasses.replace(_request(CHAT, body, "", _max_tokens(body, param), messages), max_tokens_param=param,
                                 include_reasoning=boolean(body, "include_reasoning", True))
    chat_options(body, parsed.generate)
    chat_logprobs(body, parsed.generate.sampling)
    if options.prompt_logprobs is not None:
        parsed.generate.sampling.prompt_logprobs = options.prompt_logprobs
    parsed = _with_choices(dataclasses.replace(parsed, prompt=options), body)
    tools = parse_tools(body, parsed.generate)
    if tools is not None:
        parsed = dataclasses.replace(parsed, tools=tools,
                                     structured_param="tools" if tools.constrained else parsed.structured_param)
    return _ends_with_its_structure(parsed)


def _ends_with_its_structure(parsed: OpenAIRequest) -> OpenAIRequest:
    """ignore_eos with a structured output: the scheduler refuses it in sampling's terms (the output
    ends where its grammar does); refused here first, naming the parameter."""
    param = parsed.structured_param
    if parsed.generate.sampling.ignore_eos and param is not None:
        named = "a tool_choice that constrains the output" if param == "tools" else param
        raise BadParameter("ignore_eos", f"ignore_eos cannot be combined with {named}: a structured output ends "
                                         "where its grammar does")
    return parsed


def chat_messages(messages: Any) -> list[gateway_pb2.ChatMessage]:
    """`messages` checked (roles, content a string or text parts; an assistant's tool_calls, a tool
    turn's tool_call_id) as GenerateRequest.messages."""
    if not isinstance(messages, list) or not messages:
        raise BadParameter("messages", "messages must be a non-empty list of {role, content} objects")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadParameter(f"messages[{i}]", f"messages[{i}] must be an object")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise BadParameter(f"messages[{i}].role",
                               f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {shown(role)}")
        content = message.get("content")
        if content is None and role == "assistant" and message.get("tool_calls"):
            content = ""  # OpenAI's null content of a turn that only called
        turn = gateway_pb2.ChatMessage(role=role, content=_content(content, i))
        add_turn_fields(message, i, turn)
        turns.append(turn)
    return turns


def _content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise BadParameter(f"messages[{i}].content",
                                   f"messages[{i}].content parts must be {{type: text, text: ...}}; "
                                   "images and audio are not supported")
            texts.append(part["text"])
        return "".join(texts)
    raise BadParameter(f"messages[{i}].content", f"messages[{i}].content must be a string or a list of text parts")



def _request(kind: str, body: dict, prompt: str, max_tokens: int,
             messages: list[gateway_pb2.ChatMessage] | None = None) -> OpenAIRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadParameter("model", "model is required (a model id from GET /v1/models)")
    ref = model_ref(model)
    stream = boolean(body, "stream", False)
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise BadParameter("stream_options", "stream_options is only allowed when stream is true")
        if not isinstance(options, dict):
            raise BadParameter("stream_options", "stream_options must be an object")
        include_usage = boolean(options, "include_usage", False, "stream_options.include_usage")
    sampling = common_pb2.SamplingParams(
        max_tokens=max_tokens,
        temperature=number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_top_p(body),
        stop=_stop(body),
        ignore_eos=boolean(body, "ignore_eos", False),
    )
    penalties(body, sampling)
    seed = body.get("seed")
    if seed is not None:
        if not is_int(seed) or not 0 <= seed < 2**63:
            raise BadParameter("seed", f"seed must be an integer in [0, 2**63), got {shown(seed)}")
        sampling.seed = seed
    generate = gateway_pb2.GenerateRequest(
        model=ref, prompt=prompt, sampling=sampling, messages=messages,
        # The fields the body leaves out go to the model's recommendation (its generation_config.json, as
        # vLLM applies it); where the model recommends nothing, OpenAI's default sent here stands.
        model_default_fields=[field for field, name in MODEL_DEFAULT_FIELDS.items() if body.get(name) is None])
    _tokenizing(body, generate)
    return OpenAIRequest(kind, model, generate, stream, include_usage)


def _tokenizing(body: dict, generate: gateway_pb2.GenerateRequest) -> None:
    """prompt_tokenizing, and return_token_ids (the prompt's and each choice's token ids in the answer)."""
    generate.return_token_ids = boolean(body, "return_token_ids", False)
    prompt_tokenizing(body, generate)


def prompt_tokenizing(body: dict, generate: gateway_pb2.GenerateRequest) -> None:
    """vLLM's add_special_tokens (unset: the model's way) and truncate_prompt_tokens (-1: the context; the
    scheduler keeps the prompt's last N tokens and refuses N past the model's context)."""
    if body.get("add_special_tokens") is not None:
        generate.add_special_tokens = boolean(body, "add_special_tokens", True)
    keep = body.get("truncate_prompt_tokens")
    if keep is not None:
        if not is_int(keep) or not -1 <= keep < 2**31 or keep == 0:
            raise BadParameter("truncate_prompt_tokens", "truncate_prompt_tokens must be -1 (the model's context) "
                                                         f"or an integer >= 1, got {shown(keep)}")
        generate.truncate_prompt_tokens = keep


def _with_choices(parsed: OpenAIRequest, body: dict) -> OpenAIRequest:
    """n (both endpoints) and best_of (completions), checked; request ids set so choices can name theirs."""
    n = _count(body, "n", 1, MAX_CHOICES)
    best_of = n
    if parsed.kind == COMPLETION:
        best_of = _count(body, "best_of", n, MAX_CHOICES)
        if best_of < n:
            raise BadParameter("best_of", f"best_of must be >= n ({n}), got {best_of}")
        if best_of > n and parsed.stream:
            raise BadParameter("best_of", "best_of > n cannot be streamed: the best choices are known at the end")
    elif body.get("best_of") is not None:
        raise BadParameter("best_of", "best_of is a completions parameter")
    structured_param = structured(body, parsed.generate.sampling)
    logprobs = parsed.generate.sampling.logprobs
    if best_of > n:
        parsed.generate.sampling.logprobs = True  # the ranking's input
    if best_of > 1:
        parsed.generate.request_id = uuid.uuid4().hex  # each choice's is <this>-<index>
    return dataclasses.replace(parsed, n=n, best_of=best_of, logprobs=logprobs, structured_param=structured_param)


def _count(body: dict, name: str, default: int, high: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value) or not 1 <= value <= high:
        raise BadParameter(name, f"{name} must be an integer in [1, {high}], got {shown(value)}")
    return value


# Accepted at their defaults only; anything else is refused rather than silently ignored.
_UNSUPPORTED_UNLESS = (
    ("suffix", (None, ""), "suffix is not supported"),
    ("functions", (None,), "functions are not supported"),
    ("function_call", (None, "none"), "function_call is not supported"),
    # vLLM's extensions not done here: refused rather than read as 'other fields' and silently not applied.
    ("use_beam_search", (None, False), "beam search is not supported"),
    ("length_penalty", (None, 1, 1.0), "length_penalty (beam search) is not supported"),
    ("skip_special_tokens", (None, True), "skip_special_tokens false is not supported: special tokens have no text here"),
    ("chat_template", (None, ""), "a request's own chat_template is not supported: the model's is used (vLLM without "
                                  "--trust-request-chat-template refuses it too)"),
    ("documents", (None,), "documents is not supported"),
    ("return_tokens_as_token_ids", (None, False), "return_tokens_as_token_ids is not supported"),
    ("prompt_embeds", (None,), "prompt_embeds is not supported"),
    ("logits_processors", (None,), "logits_processors is not supported"),
    ("priority", (None, 0), "priority (vLLM's integer) is not supported: send the x-infermesh-priority header "
                            "(critical, standard or sheddable)"),
    ("cache_salt", (None, ""), "cache_salt is not supported: the prefix cache is salted per tenant (a tenant's "
                               "prompts are never served from another tenant's cache)"),
)


def _completion_logprobs(body: dict, sampling: common_pb2.SamplingParams) -> None:
    """Completions: `logprobs: <int>` asks for the sampled token's logprob and that many alternatives
    (0: the sampled token's alone)."""
    if body.get("top_logprobs") is not None:
        raise BadParameter("top_logprobs", "top_logprobs is a chat parameter; completions take logprobs: "
                                           f"<0..{MAX_TOP_LOGPROBS}>")
    value = body.get("logprobs")
    if value is None:
        return
    if not is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise BadParameter("logprobs", f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {shown(value)}")
    sampling.logprobs = True
    sampling.top_logprobs = value


def _refuse_unsupported(body: dict) -> None:
    for name, allowed, message in _UNSUPPORTED_UNLESS:
        value = body.get(name)
        if not _is_default(value, allowed):
            raise BadParameter(name, f"{message}, got {shown(value)}")


def _is_default(value: Any, allowed: tuple) -> bool:
    if isinstance(value, dict | list):
        return not value
    if isinstance(value, bool):  # True == 1: n=true is not n=1
        return any(value is a for a in allowed)
    return value in allowed


def _top_p(body: dict) -> float:
    value = body.get("top_p")
    if value is None:
        return 1.0
    if not is_number(value) or not 0 < value <= 1:
        raise BadParameter("top_p", f"top_p must be a number in (0, 1], got {shown(value)}")
    return float(value)


def _max_tokens(body: dict, name: str) -> int:
    value = body.get(name)
    if value is None:
        return 0  # the model's default
    if not is_int(value) or not 1 <= value <= MAX_MAX_TOKENS:
        raise BadParameter(name, f"{name} must be an integer in [1, {MAX_MAX_TOKENS}], got {shown(value)}")
    return value


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if (not isinstance(stops, list) or len(stops) > MAX_STOP_SEQUENCES
            or not all(isinstance(s, str) and s for s in stops)):
        raise BadParameter("stop", f"stop must be a non-empty string or a list of up to {MAX_STOP_SEQUENCES} "
                                   f"non-empty strings, got {shown(value)}")
    return stops


# -- responses --------------------------------------------------------------------------


def finish_reason(chunk: gateway_pb2.GenerateResponse) -> str | None:
    return _FINISH_REASONS.get(chunk.finish_reason)


def stop_reason(request: OpenAIRequest, last: gateway_pb2.GenerateResponse) -> str | int | None:
    """vLLM's stop_reason: the stop string, or the request's stop_token_ids id, that ended the choice;
    None for the model's end of sequence, the length, or anything else."""
    if last.stop_string:
        return last.stop_string
    if last.HasField("end_token_id") and last.end_token_id in request.generate.sampling.stop_token_ids:
        return last.end_token_id
    return None


def usage(*lasts: gateway_pb2.GenerateResponse, echo_only: bool = False) -> dict:
    """The last chunks of every choice: the prompt counted once (the first choice's, which computed
    it), the completion tokens of every choice generated (best_of's unreturned ones too); none for
    echo with max_tokens 0 (the token generated upstream is dropped)."""
    prompt, cached = lasts[0].usage.prompt_tokens, lasts[0].usage.cached_prompt_tokens
    completion = 0 if echo_only else sum(last.usage.completion_tokens for last in lasts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            # OpenAI's and vLLM's field: prompt tokens served from the prefix cache.
            "prompt_tokens_details": {"cached_tokens": cached}}


def timings(chunk: gateway_pb2.GenerateResponse) -> dict:
    """The extension field: every stage the hops reported, microseconds."""
    return {
        "total_us": chunk.timings.total_us,
        "stages": [{"service": s.service, "stage": _STAGE_NAMES.get(s.stage, str(s.stage)),
                    "duration_us": s.duration_us} for s in chunk.timings.stages],
    }


def timings_header(chunk: gateway_pb2.GenerateResponse) -> str:
    """x-infermesh-timings in Server-Timing syntax: `<service>.<stage>;dur=<ms>`, then `total`."""
    parts = [f"{s.service}.{_STAGE_NAMES.get(s.stage, s.stage)};dur={s.duration_us / 1000:.3f}"
             for s in chunk.timings.stages]
    parts.append(f"total;dur={chunk.timings.total_us / 1000:.3f}")
    return ", ".join(parts)


def response_id(request: OpenAIRequest) -> str:
    prefix = "cmpl-" if request.kind == COMPLETION else "chatcmpl-"
    return prefix + request.generate.request_id


class LogprobsWriter:
    """One choice's logprobs in OpenAI's shape, chunk after chunk: completions' text_offset counts
    on from the tokens written before (each token's text as the tokenizer decodes it alone)."""

    def __init__(self, request: OpenAIRequest) -> None:
        self._completion = request.kind == COMPLETION
        self._wanted = request.logprobs
        self._text_offset = 0

    def write_prompt(self, positions: Sequence[common_pb2.PositionLogprobs], k: int) -> dict | None:
        """Completions' echo: the prompt tokens' entries, before the completion's (the first token's
        logprob and top_logprobs null, as OpenAI's legacy API and vLLM write them)."""
        written = self.write(positions)
        if written is not None:
            written["top_logprobs"] = [None if math.isnan(p.token.logprob) else _completion_top(p, k)
                                       for p in positions]
        return written

    def write(self, positions: Sequence[common_pb2.PositionLogprobs]) -> dict | None:
        """The `logprobs` object of a choice holding these positions; None when none were asked for."""
        if not self._wanted:
            return None
        if not self._completion:
            return {"content": [_chat_entry(p) for p in positions], "refusal": None}
        tokens = [_token_text(p.token) for p in positions]
        offsets = []
        for token in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": [_logprob(p.token) for p in positions],
                "top_logprobs": [_completion_top(p) for p in positions], "text_offset": offsets}


def _spelled(positions: Sequence[common_pb2.PositionLogprobs]) -> str:
    """A token prompt's text: its tokens' bytes, as the model's tokenizer spells them, decoded together."""
    return b"".join(p.token.token_bytes for p in positions).decode("utf-8", errors="replace")


def _token_text(token: common_pb2.TokenLogprob) -> str:
    return token.token_bytes.decode("utf-8", errors="replace")


def _logprob(token: common_pb2.TokenLogprob) -> float | None:
    """NaN (a worker that reported none) as null: JSON has no NaN."""
    return None if math.isnan(token.logprob) else token.logprob


def completion_choice(request: OpenAIRequest, index: int, text: str,
                      positions: Sequence[common_pb2.PositionLogprobs], reason: str | None,
                      prompt: Sequence[common_pb2.PositionLogprobs] | None, writer: LogprobsWriter) -> dict:
    """A completions choice, whole or a stream's event. `prompt`: the prompt's logprobs on the first
    (None on a stream's later events): echo writes the prompt, and its tokens' logprobs, first; vLLM's
    prompt_logprobs ride with it. echo with max_tokens 0 drops what was generated, and ends by length
    even when the dropped token was an end of sequence or ended a stop string."""
    options = request.prompt
    if options.echo_only:
        text, positions = "", ()
        reason = reason and "length"
    echoed = None
    if prompt is not None and options.echo:
        text = (request.generate.prompt or _spelled(prompt)) + text
        echoed = writer.write_prompt(prompt, request.generate.sampling.top_logprobs)  # its text_offset first
    written = writer.write(positions)
    if echoed is not None and written is not None:
        written = {key: echoed[key] + written[key] for key in echoed}
    choice = {"index": index, "text": text, "logprobs": written, "finish_reason": reason}
    if prompt is not None and options.prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt, options.prompt_logprobs)
    return choice


def _chat_top(token: common_pb2.TokenLogprob) -> dict:
    return {"token": _token_text(token), "logprob": _logprob(token), "bytes": list(token.token_bytes)}


def _chat_entry(position: common_pb2.PositionLogprobs) -> dict:
    return {**_chat_top(position.token), "top_logprobs": [_chat_top(t) for t in position.top]}


def _completion_top(position: common_pb2.PositionLogprobs, k: int | None = None) -> dict[str, float | None]:
    """The alternatives (the first k) and the sampled token (OpenAI: "up to logprobs + 1 elements")."""
    top = {_token_text(t): _logprob(t) for t in position.top[:k]}
    top.setdefault(_token_text(position.token), _logprob(position.token))
    return top


def full_response(request: OpenAIRequest, created_s: int, returned: Sequence[ChoiceResult],
                  generated: Sequence[ChoiceResult] = ()) -> dict:
    """`returned`: the choices to return, in order; `generated`: every choice generated, for usage
    (empty: the returned ones)."""
    # The first choice's first chunk brought the prompt's logprobs (the other choices ask for none).
    prompt = (generated or returned)[0].prompt_logprobs
    choices = [_choice(request, index, result, prompt) for index, result in enumerate(returned)]
    first = _last_of(returned[0])
    body = {
        "id": response_id(request), "object": request.kind, "created": created_s, "model": request.model,
        "choices": choices,
        "usage": usage(*(_last_of(r) for r in (generated or returned)), echo_only=request.prompt.echo_only),
        "infermesh": {"request_id": request.generate.request_id, "timings": timings(first)},
    }
    if request.kind == CHAT and request.prompt.prompt_logprobs is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(prompt, request.prompt.prompt_logprobs)  # vLLM's place
    if request.generate.return_token_ids:  # vLLM's places: the prompt's per choice (completions) or once (chat)
        prompt_ids = (generated or returned)[0].prompt_token_ids
        for choice, result in zip(choices, returned, strict=True):
            if request.kind == COMPLETION:
                choice["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = result.token_ids
        if request.kind == CHAT:
            body["prompt_token_ids"] = prompt_ids
    return body


def constrained(request: OpenAIRequest) -> bool:
    """Whether a grammar holds the output (response_format, guided_*, a required or named tool
    choice): its reasoning split assumes no reasoning unless the first chunk says the grammar waited
    for it (reasoning.py)."""
    return request.generate.sampling.HasField("structured")


def _last_of(result: ChoiceResult) -> gateway_pb2.GenerateResponse:
    if result.last is None:
        raise ValueError("a choice without its last chunk")
    return result.last


def _choice(request: OpenAIRequest, index: int, result: ChoiceResult,
            prompt: Sequence[common_pb2.PositionLogprobs] = ()) -> dict:
    last = _last_of(result)
    reason = finish_reason(last)
    if request.kind == COMPLETION:
        choice = completion_choice(request, index, result.text, result.logprobs, reason, prompt, LogprobsWriter(request))
        return {**choice, "stop_reason": None if request.prompt.echo_only else stop_reason(request, last)}
    written = LogprobsWriter(request).write(result.logprobs)
    reasoning, answer = split_reasoning(result.text, result.reasoning, constrained(request))
    splitter = ToolCallSplitter(request.tools)
    splitter.feed(answer, True, result.tool_call_parser)
    if not request.include_reasoning:
        reasoning = ""
    return {"index": index, "message": chat_message(splitter.message(), reasoning), "logprobs": written,
            "finish_reason": splitter.finish_reason(reason), "stop_reason": stop_reason(request, last)}


def stream_chunk(request: OpenAIRequest, created_s: int, chunk: gateway_pb2.GenerateResponse, first: bool,
                 logprobs: LogprobsWriter | None = None, index: int = 0, tools: ToolCallSplitter | None = None,
                 parser: str = "", prompt: Sequence[common_pb2.PositionLogprobs] = (),
                 reasoning: ReasoningSplitter | None = None) -> dict:
    """One SSE event's object for one upstream chunk of choice `index`; the last carries finish_reason
    and the timings. `first`: the choice's first chunk. `logprobs`: the choice's writer (one per
    choice), when the request asked for logprobs. `tools`: the choice's splitter (chat; one per
    choice), `parser` the tool-call format its first chunk named. `prompt`: the prompt's logprobs
    (the first choice's first chunk brought them), for a first chunk's echo and prompt_logprobs.
    `reasoning`: the choice's reasoning splitter (chat; none: no reasoning is split off); tool
    calls are read from the answer after it."""
    reason = finish_reason(chunk)
    if request.kind == COMPLETION:
        choice = completion_choice(request, index, chunk.text, chunk.logprobs, reason, prompt if first else None,
                                   logprobs or LogprobsWriter(dataclasses.replace(request, logprobs=False)))
        kind = COMPLETION
    else:
        written = logprobs.write(chunk.logprobs) if logprobs is not None else None
        splitter = tools if tools is not None else ToolCallSplitter(None)
        thought, answer = reasoning.feed(chunk.text, reason is not None) if reasoning is not None else ("", chunk.text)
        content, calls = splitter.feed(answer, reason is not None, parser)
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if thought and request.include_reasoning:
            delta.update(reasoning_delta(thought))
        if content or (not calls and not thought and (first or reason is None)):
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        choice = {"index": index, "delta": delta, "logprobs": written, "finish_reason": splitter.finish_reason(reason)}
        kind = "chat.completion.chunk"
    event = {"id": response_id(request), "object": kind, "created": created_s, "model": request.model,
             "choices": [choice]}
    if reason is not None:
        choice["stop_reason"] = None if request.prompt.echo_only else stop_reason(request, chunk)
    if request.generate.return_token_ids:
        choice["token_ids"] = chunk_token_ids(chunk)
        if chunk.prompt_token_ids:  # the choice's first chunk
            (choice if request.kind == COMPLETION else event)["prompt_token_ids"] = list(chunk.prompt_token_ids)
    if request.include_usage:
        event["usage"] = None
    if first and request.kind == CHAT and request.prompt.prompt_logprobs is not None and prompt is not None:
        event["prompt_logprobs"] = vllm_prompt_logprobs(prompt, request.prompt.prompt_logprobs)
    if reason is not None:
        event["infermesh"] = {"request_id": request.generate.request_id, "timings": timings(chunk)}
    return event


def usage_chunk(request: OpenAIRequest, created_s: int, *lasts: gateway_pb2.GenerateResponse) -> dict:
    """stream_options.include_usage: the extra last event, with no choices; `lasts`: every choice's last chunk."""
    kind = COMPLETION if request.kind == COMPLETION else "chat.completion.chunk"
    return {"id": response_id(request), "object": kind, "created": created_s, "model": request.model,
            "choices": [], "usage": usage(*lasts, echo_only=request.prompt.echo_only)}


# -- errors -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ErrorReply:
    refusal: HttpRefusal  # status and Retry-After (http_status.py, shared with KServe REST)
    body: dict

    @property
    def status(self) -> int:
        return self.refusal.status


class ContextLengthExceeded(BadParameter):
    """The prompt, or the prompt and max_tokens, do not fit the model's context (the scheduler's to say:
    it has the token count); OpenAI's code for it."""


# Domain error -> (OpenAI error type, code); the status is http_status.py's.
_ERROR_TYPES: dict[type, tuple[str, str | None]] = {
    ContextLengthExceeded: ("invalid_request_error", "context_length_exceeded"),
    QuotaExceeded: ("rate_limit_error", "rate_limit_exceeded"),
    ObjectiveMissed: ("overloaded_error", "ttft_objective_missed"),
    ObjectiveUnmeetable: ("invalid_request_error", "ttft_objective_unmeetable"),
    TpotUnmeetable: ("invalid_request_error", "tpot_objective_unmeetable"),
    errors.InvalidArgument: ("invalid_request_error", None),
    errors.Unauthenticated: ("authentication_error", "invalid_api_key"),
    errors.PermissionDenied: ("permission_error", "model_not_allowed"),
    ResponseNotFound: ("invalid_request_error", None),  # OpenAI's for an unknown response id
    errors.NotFound: ("not_found_error", "model_not_found"),
    errors.ResourceExhausted: ("overloaded_error", "overloaded"),
    errors.Unavailable: ("service_unavailable_error", "unavailable"),
    errors.DeadlineExceeded: ("timeout_error", "deadline_exceeded"),
    errors.Cancelled: ("cancelled_error", "cancelled"),
    errors.Internal: ("internal_error", "internal"),
}


def error_reply(err: errors.InfermeshError) -> ErrorReply:
    kind, code = _ERROR_TYPES[matching(_ERROR_TYPES, err)]
    return ErrorReply(http_refusal(err), error_body(err.message, kind, _param(err), code))


# Parameters only the scheduler can check (it has the tokenizer, and its own byte cap on stop strings):
# its message names the field.
_UPSTREAM_PARAMS = ("logit_bias", "stop_token_ids", "stop", "min_tokens", "allowed_token_ids",
                    "bad_words")  # stop_token_ids before its prefix
# The scheduler's refusals of how the prompt is made (call_codec.chat_rendering and truncated_prompt, chat_template.py).
_UPSTREAM_REQUEST_PARAMS = ("chat_template_kwargs", "continue_final_message", "truncate_prompt_tokens")
# The scheduler's context-length refusals (scheduler/servicer.py, generate_pool.py): what they read as.
_PROMPT_AND_MAX_TOKENS_OVER = re.compile(r"prompt of \d+ tokens plus max_tokens \d+ exceeds")
_PROMPT_OVER = re.compile(r"prompt of \d+ tokens does not fit")


def upstream_refusal(err: errors.InfermeshError, request: OpenAIRequest) -> errors.InfermeshError:
    """The scheduler's refusals in the client's terms: a structured output's (it compiles the schema,
    and finds a grammar that forces an endless sequence while sampling) names the parameter the
    client set it with; a context-length one names max_tokens when the prompt alone fits (as the
    client can lower it), the prompt (messages in chat) otherwise, with OpenAI's code; a token prompt's
    id outside the vocabulary names the prompt."""
    if not isinstance(err, errors.InvalidArgument):
        return err
    if request.structured_param is not None and err.message.startswith("sampling.structured"):
        return BadParameter(request.structured_param, err.message)
    if _PROMPT_AND_MAX_TOKENS_OVER.match(err.message):
        return ContextLengthExceeded(request.max_tokens_param, err.message)
    if _PROMPT_OVER.match(err.message):
        return ContextLengthExceeded("messages" if request.kind == CHAT else "prompt", err.message)
    if err.message.startswith("prompt_token_ids"):  # a token id past the model's vocabulary: its prompt's
        return BadParameter("prompt", "prompt" + err.message.removeprefix("prompt_token_ids"))
    return err


def _param(err: errors.InfermeshError) -> str | None:
    param = getattr(err, "param", None)
    if param is None and isinstance(err, errors.InvalidArgument):
        for name in _UPSTREAM_PARAMS:
            if err.message.startswith(f"sampling.{name}"):
                return name
        for name in _UPSTREAM_REQUEST_PARAMS:
            if err.message.startswith(name):
                return name
    return param


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
