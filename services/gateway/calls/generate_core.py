"""Generate at the edge, whatever the transport: the gRPC servicer and the OpenAI HTTP front both run this.

One request, in order: validate, admit (admission.py: in-flight cap, auth, model allowed, routing,
deadline, shedding, quota, the model's adaptive limit), fix the sampling seed, dispatch with retries
and resumes (dispatch/dispatcher.py), keep the quota's usage current for the refund, and add the gateway's
stage timings to the last chunk. A front hands in what its transport carried as a `Caller` and gets
chunks or a domain error (services/common/errors.py), which it maps to its own status codes.

A client may ask for a lower priority class than its tenant's (`x-infermesh-priority`, gRPC
metadata or HTTP header), never a higher one: a batch job of a critical tenant can mark itself
sheddable, a sheddable tenant cannot jump the queue.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import cast

from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2
from services.common import errors
from services.common.generate_input import check_input
from services.common.log_context import bind
from services.common.objectives import LatencyObjective, request_override
from services.common.priority import Priority
from services.common.protocol import DEFAULT_MAX_TOKENS
from services.common.stream_options import stream_options
from services.gateway.admission.admission import Admission, RequestScope
from services.gateway.calls.stage_timings import gateway_stages, ingress_s
from services.gateway.dispatch.dispatcher import Dispatcher
from services.gateway.rollout.shadow import ShadowMirror
from services.gateway.telemetry.tracing import span
from services.gateway.tenants.credentials import Authorization
from services.gateway.tenants.directory import Tenant

SERVICE = "gateway"
PRIORITY_KEY = "x-infermesh-priority"
_PRIORITY_BY_NAME = {p.name.lower(): p for p in Priority}


def parse_priority(value: str | bytes | None) -> Priority | None:
    """The class a request asks for (`critical`, `standard`, `sheddable`); None when it names none."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    text = value.strip().lower()
    if not text:
        return None
    priority = _PRIORITY_BY_NAME.get(text)
    if priority is None:
        raise errors.InvalidArgument(
            f"{PRIORITY_KEY} must be one of {', '.join(_PRIORITY_BY_NAME)}, got {value[:40]!r}")
    return priority


@dataclass(frozen=True)
class Caller:
    """What one request's transport said about its caller, read once by the front."""

    # The authorization value, or Credentials with the verified client certificate's names.
    authorization: Authorization
    # The client's send time (x-request-start), unix seconds; None when it sent none.
    request_start_s: float | None = None
    # The client's remaining time, seconds; None when it set no deadline (the gateway's default applies).
    timeout_s: float | None = None
    # The x-infermesh-priority value as sent (checked with the request, so a bad one is counted like
    # any bad input); None: the tenant's class.
    priority: str | bytes | None = None
    # Key/value pairs the trace context is read from (traceparent, tracestate).
    metadata: Iterable[tuple[str, str | bytes]] = ()
    # x-infermesh-ttft-ms / x-infermesh-tpot-ms as sent (common/objectives.py); None: not sent.
    ttft_ms: str | bytes | None = None
    tpot_ms: str | bytes | None = None


# Special tokens a tokenizer may add to a prompt beyond one per byte: a BOS, and SentencePiece's
# leading '▁' (a space the text never held; Llama 2 and Mistral add both).
PROMPT_EXTRA_TOKENS = 2
# A chat template's own tokens, per message (Llama 3: <|start_header_id|>, the role,
# <|end_header_id|>, two newlines, <|eot_id|>; ChatML's are fewer) and once per conversation
# (BOS, the generation prompt's header, and the default system text some templates add: Qwen2.5's
# "You are Qwen, created by Alibaba Cloud...", Llama 3.1's knowledge and today's dates).
CHAT_TOKENS_PER_MESSAGE = 8
CHAT_TOKENS_PER_CONVERSATION = 64


def prompt_tokens_upper_bound(prompt: str) -> int:
    """The quota's hold for a prompt: every tokenizer spends at least one byte per token (byte
    fallback included), plus the special tokens it adds. The exact count comes back in the last
    chunk's usage, and the charge is settled to it."""
    return len(prompt.encode("utf-8")) + PROMPT_EXTRA_TOKENS


def chat_tokens_estimate(messages: Sequence[gateway_pb2.ChatMessage], tools: Sequence[gateway_pb2.Tool] = ()) -> int:
    """The quota's hold for a conversation: its text's bytes (the calls, results and tools it
    carries too) and an allowance for the template's own tokens. The gateway does not render the
    template (the scheduler does, once), so this is an estimate: a template that adds more than the
    allowance (a long default system prompt, tool instructions) is charged the difference when its
    usage comes back."""
    num_bytes = sum(len(m.role.encode("utf-8")) + len(m.content.encode("utf-8")) + len(m.tool_call_id)
                    + sum(len(c.name) + len(c.arguments.encode("utf-8")) for c in m.tool_calls) for m in messages)
    num_bytes += sum(len(t.name) + len(t.description.encode("utf-8")) + len(t.parameters.encode("utf-8"))
                     for t in tools)
    return num_bytes + CHAT_TOKENS_PER_MESSAGE * len(messages) + CHAT_TOKENS_PER_CONVERSATION


def prompt_tokens_estimate(request: gateway_pb2.GenerateRequest) -> int:
    if request.prompt_token_ids:
        estimate = len(request.prompt_token_ids)  # exact: the scheduler uses them as they are
    elif request.prompt:
        estimate = prompt_tokens_upper_bound(request.prompt)
    else:
        estimate = chat_tokens_estimate(request.messages, request.tools)
    if request.truncate_prompt_tokens > 0:  # the scheduler keeps no more (-1: the context, which caps it anyway)
        return min(estimate, request.truncate_prompt_tokens)
    return estimate


def quota_hold(request: gateway_pb2.GenerateRequest, context_len: int) -> tuple[int, int]:
    """(prompt tokens, prompt + output tokens) the quota holds for a request until its usage comes
    back. No sequence holds more than its model's context (the scheduler refuses a longer one), so
    a known context caps both: a prompt too long for the model reaches the scheduler, which says
    so with both lengths (400), instead of meeting the tenant's token burst first (429)."""
    prompt_tokens = prompt_tokens_estimate(request)
    # An embedding (request.embed) generates nothing: its prompt is all it uses.
    num_tokens = prompt_tokens + (0 if request.HasField("embed") else request.sampling.max_tokens or DEFAULT_MAX_TOKENS)
    if context_len > 0:
        return min(prompt_tokens, context_len), min(num_tokens, context_len)
    return prompt_tokens, num_tokens


def schedule_request(request: gateway_pb2.GenerateRequest, scope: RequestScope,
                     judged: bool) -> scheduler_pb2.ScheduleGenerateRequest:
    """What goes to the scheduler: the request and its tenant, and where admission judged its predicted TTFT
    (`judged`), the factor it multiplied the predictions by: the scheduler's own check at submission applies it
    when below 1, so it does not refuse what admission let through on a correction below 1."""
    upstream = scheduler_pb2.ScheduleGenerateRequest(request=request, tenant=tenant_context(scope.admitted_tenant))
    if judged and scope.objective is not None:
        upstream.ttft_prediction_factor = scope.ttft_correction
    return upstream


def tenant_context(tenant: Tenant) -> scheduler_pb2.TenantContext:
    # The enum's number (Priority's values are infermesh.v1.Priority's); the .pyi only lists enum members.
    priority = cast("common_pb2.Priority", int(tenant.priority))
    return scheduler_pb2.TenantContext(tenant_id=tenant.tenant_id, priority=priority, weight=tenant.weight)


def fix_seed(sampling: common_pb2.SamplingParams, seed_source: Callable[[], int]) -> None:
    """Sets a seed (< 2**63) on a sampled request that has none, before its first attempt.

    Sampling is a function of (seed, position), so with the seed fixed here a stream
    resumed on another scheduler samples exactly what the unbroken one would have.
    Greedy requests need none.
    """
    if sampling.temperature > 0 and not sampling.HasField("seed"):
        sampling.seed = seed_source()


@dataclass(frozen=True)
class HandlerTimes:
    """When one request's handler ran, on the gateway's monotonic clock (and the wall clock for ingress)."""

    began_s: float
    began_unix_s: float
    request_start_s: float | None

    @classmethod
    def start(cls, scope: RequestScope, request_start_s: float | None) -> HandlerTimes:
        return cls(scope.began_s, time.time(), request_start_s)


def append_gateway_timings(timings: common_pb2.Timings, handler: HandlerTimes, admitted_s: float,
                           upstream_done_s: float | None, now_s: float) -> None:
    """Adds the gateway's stages to the upstream's (whose total_us is the scheduler's) and sets the total."""
    stages = gateway_stages(
        ingress_s=ingress_s(handler.request_start_s, handler.began_unix_s),
        admission_s=admitted_s - handler.began_s,
        upstream_s=None if upstream_done_s is None else upstream_done_s - admitted_s,
        upstream_total_us=timings.total_us,
        total_s=now_s - handler.began_s,
    )
    add = timings.stages.add
    for stage in stages:
        add(stage=_STAGE_VALUES[stage.stage], duration_us=stage.duration_us, service=SERVICE)
    timings.total_us = stages[-1].duration_us


_STAGE_VALUES = {name.removeprefix("STAGE_").lower(): value for name, value in common_pb2.Stage.items()}


class GenerateCore:
    def __init__(self, admission: Admission, dispatcher: Dispatcher, clock=time.monotonic,
                 seed_source: Callable[[], int] = lambda: secrets.randbits(63),
                 shadow: ShadowMirror | None = None,
                 context_len: Callable[[str, str], int] = lambda name, version: 0) -> None:
        """`context_len(name, version)`: the most tokens (prompt + output) a sequence of that model
        may hold, as its schedulers reported it (the largest of its versions when version is "");
        0 when unknown."""
        self._admission = admission
        self._dispatcher = dispatcher
        self._clock = clock
        self._seed_source = seed_source
        self._shadow = shadow
        self._context_len = context_len

    async def generate(self, request: gateway_pb2.GenerateRequest, caller: Caller, *, further_choice: bool = False,
                       on_admitted: Callable[[], None] | None = None,
                       ) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        """The request's chunks; the last has finish_reason, usage and every stage's timings.

        `further_choice`: a choice after the first of a request with several (n, best_of), started once the
        first streamed: admitted like any request but not judged on its TTFT target, here or at the scheduler
        (the first choice was); its TPOT target still paces it (openai_choices.py).

        Admission runs on the first iteration, so a refusal is raised before any chunk; `on_admitted` is
        told when it let the request through (a background Response is answered then). Closing
        the iterator early (the client went away) cancels the upstream stream, which frees the
        sequence's KV blocks at the scheduler's next step."""
        request.request_id = request.request_id or uuid.uuid4().hex
        bind(request_id=request.request_id)
        with self._admission.scope("Generate", request.model.name, request.model.version,
                                   caller.metadata, caller.authorization) as scope:
            handler = HandlerTimes.start(scope, caller.request_start_s)
            waited_s = ingress_s(caller.request_start_s, handler.began_unix_s) or 0.0
            with span("admission"):
                prompt_tokens = self._admit(scope, request, caller, waited_s, further_choice)
            admitted_s = self._clock()
            if on_admitted is not None:
                on_admitted()
            upstream = schedule_request(request, scope, self._admission.parts.ttft_admission)

            def call(client, version: str, timeout_s: float, continuation: tuple[int, ...]):
                upstream.request.model.version = version
                if continuation:
                    upstream.continuation.token_ids[:] = continuation
                return client.generate(upstream, timeout_s)

            num_generated = 0
            # Until the last chunk says what was used: the prompt once generation started, plus tokens sent.
            scope.num_tokens_used = 0
            # A greedy version-less stream at a rollout's shadow step: its tokens, to compare.
            mirrored: list[int] | None = None
            if (self._shadow is not None and request.sampling.temperature == 0
                    and self._shadow.wants(request.model.name, request.model.version) is not None):
                mirrored = []

            def on_chunk(chunk: gateway_pb2.GenerateResponse) -> None:
                nonlocal num_generated
                if num_generated == 0 and scope.model_permit is not None:
                    scope.model_permit.first_response()
                num_generated += len(chunk.token_ids)
                scope.tokens_sent(len(chunk.token_ids))
                if mirrored is not None:
                    mirrored.extend(chunk.token_ids)
                scope.served_by(chunk.model.version)  # set on the first and the last chunk
                if chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    scope.num_tokens_used = tokens_charged(chunk.usage)
                    now_s = self._clock()
                    append_gateway_timings(chunk.timings, handler, admitted_s, now_s, now_s)
                    scope.timings = chunk.timings
                    if scope.predicted_ttft_s is not None:  # from the client's send, as it measures
                        chunk.predicted_ttft_us = round((waited_s + scope.predicted_ttft_s) * 1e6)
                else:
                    scope.num_tokens_used = prompt_tokens + num_generated

            async for chunk in self._dispatcher.stream(scope, call, on_chunk):
                yield chunk
            if mirrored is not None and self._shadow is not None:
                self._shadow.generate(request.model.name, request, mirrored, scope.tenant_id)

    def _admit(self, scope: RequestScope, request: gateway_pb2.GenerateRequest, caller: Caller,
               waited_s: float, further_choice: bool = False) -> int:
        """Checks the request and admits it; the prompt's token estimate, for the running quota charge.
        `waited_s`: its wait before the handler ran, which its TTFT target has already lost."""

        def check_request() -> None:
            if not request.model.name:
                raise errors.InvalidArgument("model.name is required")
            check_input(request.prompt, request.messages, request.tools, request.prompt_token_ids)
            # Refused here with the scheduler's own check: coalescing itself happens upstream.
            stream_options(request.stream.max_tokens_per_chunk, request.stream.interval_ms)

        prompt_tokens, num_tokens = quota_hold(request, self._context_len(request.model.name, request.model.version))
        priority = parse_priority(caller.priority)
        wanted = request.objectives
        self._admission.admit(scope, caller.authorization, caller.timeout_s, num_tokens, priority=priority,
                              check_request=check_request,
                              objective=lambda: request_override(wanted.ttft_ms, wanted.tpot_ms,
                                                                 caller.ttft_ms, caller.tpot_ms),
                              waited_s=waited_s, num_prompt_tokens=prompt_tokens, judge_ttft=not further_choice)
        forward_objective(request, scope.objective, self._admission.parts.ttft_admission)
        if further_choice:
            request.objectives.ClearField("ttft_ms")  # the scheduler judges none (0), and paces by its TPOT
        fix_seed(request.sampling, self._seed_source)
        return prompt_tokens


def forward_objective(request: gateway_pb2.GenerateRequest, objective: LatencyObjective | None,
                      judged: bool) -> None:
    """What the scheduler is told of the request's targets: the resolved ones, which it judges and paces by
    (`judged`); none, not even those the client sent, with admission on predicted latency off
    (--slo-admission false: deadlines alone, end to end)."""
    if objective is not None and judged:
        send_objective(request, objective)
    else:
        request.ClearField("objectives")


def send_objective(request: gateway_pb2.GenerateRequest, objective: LatencyObjective) -> None:
    """The resolved targets travel on to the scheduler in the request, in whole milliseconds (>= 1)."""
    request.objectives.ttft_ms = max(1, round(objective.ttft_ms))
    request.objectives.tpot_ms = max(1, round(objective.tpot_ms))


def tokens_charged(usage: common_pb2.Usage) -> int:
    """What a finished generation costs its tenant's token quota: the prompt tokens computed for it
    (not those the scheduler's prefix cache held) and the completion."""
    return max(0, usage.prompt_tokens - usage.cached_prompt_tokens) + usage.completion_tokens
