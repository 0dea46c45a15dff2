"""Scheduler gRPC servicer: each RPC's protobuf to the pools and back (call_codec.py, and the
Attach stream's session in attach_session.py), domain errors -> statuses."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any, cast

import grpc

from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common import errors
from services.common.clock import Clock
from services.common.deadlines import budget_s, remaining_s
from services.common.log_context import bind
from services.common.protocol import DEFAULT_MAX_TOKENS
from services.common.request_decoding import Undecodable
from services.common.status import abort as abort_with
from services.common.status import maps_domain_errors, set_error_status
from services.common.stream_options import stream_options
from services.common.telemetry import (
    carrier_for,
    context_from_carrier,
    context_from_metadata,
    record_stage_span,
    server_span,
    tracer,
)
from services.common.timings import seconds_to_us
from services.scheduler import metrics
from services.scheduler.attach_session import AttachSessions
from services.scheduler.attach_types import ModelKey, WorkerHello
from services.scheduler.call_codec import (
    KIND_TO_WIRE,
    TenantCodec,
    add_labels,
    add_stages,
    decode_sampling,
    encode_pressure,
    prediction_factor,
    prompt_token_ids,
    truncated_prompt,
    with_model_defaults,
)
from services.scheduler.chunk_coalescer import ChunkCoalescer, CoalescedEvents
from services.scheduler.classify_pool import ClassifyJob, ClassifyOutcome
from services.scheduler.config import SchedulerConfig
from services.scheduler.embed_request import check_task
from services.scheduler.generate_call import ChunkSink, GenerateCall
from services.scheduler.generate_stream import EventSink, GenerateStream, StreamEvent
from services.scheduler.in_flight import InFlightCalls, draining_error, idle
from services.scheduler.model_registry import ClassifierEntry, GeneratorEntry, ModelEntry, ModelRegistry
from services.scheduler.request_metrics import RequestMetrics
from services.scheduler.sequence import SamplingParams
from services.scheduler.step_scheduler import StepScheduler, StepSchedulerFactory
from services.scheduler.step_scheduler_config import step_scheduler_config
from services.scheduler.submit_stream import SubmitStream
from services.scheduler.text_calls import detokenize, tokenize, tokenizer_info
from services.scheduler.worker_features import WorkerFeature
from services.scheduler.worker_link import WorkerLink

log = logging.getLogger(__name__)
_tracer = tracer("infermesh.scheduler")
SERVICE = "scheduler"


def _deadline_s(remaining: float | None, now_s: float, margin_s: float) -> float | None:
    """The call's deadline on this clock; remaining: the caller's budget (gRPC deadline or entry timeout)."""
    left_s = budget_s(remaining)
    return None if left_s is None else now_s + left_s - margin_s


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, config: SchedulerConfig, clock: Clock = time.monotonic,
                 step_scheduler: StepSchedulerFactory = StepScheduler) -> None:
        """`step_scheduler`: each generator worker's StepScheduler (bench/static_batching.py's baseline)."""
        self._config = config
        self._clock = clock
        self.registry = ModelRegistry(config, step_scheduler)
        self._sessions = AttachSessions(self.registry, f"scheduler-{uuid.uuid4().hex[:8]}",
                                        config.heartbeat_interval_ms, config.worker_timeout_ms, clock)
        self._tenants = TenantCodec()
        self._submit_streams: set[SubmitStream] = set()
        self._metrics = RequestMetrics(self.registry.knows, clock)
        self._draining = False
        self._in_flight: InFlightCalls[GenerateCall] = InFlightCalls()

    # -- Classify --------------------------------------------------------------

    @maps_domain_errors
    async def Classify(self, request: scheduler_pb2.ScheduleClassifyRequest, context) -> scheduler_pb2.ScheduleClassifyResponse:
        reply = scheduler_pb2.ScheduleClassifyResponse()
        parent = context_from_metadata(context.invocation_metadata())
        try:
            await self._classify(request, parent, remaining_s(context), lambda: reply.response)
        except errors.InfermeshError as exc:
            # Refusals are most of a flood's calls: answered without an AbortError (set_error_status).
            set_error_status(context, exc)
        return reply

    def classify_call(self, request: scheduler_pb2.ScheduleClassifyRequest, carrier: dict[str, str],
                      remaining_s: float | None,
                      respond: Callable[[], gateway_pb2.ClassifyResponse]) -> Coroutine[Any, Any, None]:
        """Classify on a Submit stream: the same core, the response built in the stream's outbox."""
        return self._classify(request, context_from_carrier(carrier), remaining_s, respond)

    async def _classify(self, request: scheduler_pb2.ScheduleClassifyRequest, parent: Any, remaining_s: float | None,
                        respond: Callable[[], gateway_pb2.ClassifyResponse]) -> None:
        """Validate, queue for the batcher, await the worker; `respond()` gives the message to fill
        (built in place: this runs for every classify request)."""
        began_s = self._clock()
        bind(request_id=request.request.request_id, tenant=request.tenant.tenant_id)
        with (
            server_span(_tracer, "infermesh.v1.Scheduler/Classify", parent) as span,
            self._metrics.counted(request.request.model.name, request.tenant.tenant_id, "classify", began_s),
        ):
            self._refuse_if_draining()
            req = request.request
            is_tensor = len(req.inputs) > 0
            if not is_tensor and (not req.HasField("image") or req.image.WhichOneof("data") is None):
                raise errors.InvalidArgument("image is required (encoded bytes or raw pixels)")
            entry = self.registry.resolve_classifier(req.model.name, req.model.version)
            _check_payload_fits(entry.key, entry.hello, is_tensor)
            num_labels = len(entry.hello.labels)
            if num_labels and req.top_k > num_labels:
                raise errors.InvalidArgument(f"top_k {req.top_k} exceeds the {num_labels} classes of {entry.key}")
            span.set_attribute("infermesh.model", str(entry.key))
            span.set_attribute("infermesh.tenant", request.tenant.tenant_id)
            shape, rows = _tensor_shape(req.inputs) if is_tensor else (None, 1)
            job = ClassifyJob(
                image=None if is_tensor else req.image,
                inputs=req.inputs,
                shape=shape,
                rows=rows,
                top_k=req.top_k,
                tenant=self._tenants.decode(request.tenant),
                enqueued_s=began_s,
                deadline_s=_deadline_s(remaining_s, began_s, self._config.deadline_margin_ms / 1000),
                trace_context=carrier_for(),
            )
            self._in_flight.classify_began()
            try:
                outcome = await entry.pool.submit(job)
            except asyncio.CancelledError:
                entry.pool.cancel(job)
                raise
            finally:
                self._in_flight.classify_ended()
            self._record_wait_spans(job, outcome)
            span.set_attribute("infermesh.batch_size", outcome.batch_size)
            response = respond()
            response.request_id = req.request_id
            response.model.name, response.model.version = entry.key.name, entry.key.version
            add_labels(response, outcome.labels)
            response.outputs.extend(outcome.outputs)
            self._classify_timings(response.timings, outcome, began_s)

    def _classify_timings(self, timings: common_pb2.Timings, outcome: ClassifyOutcome, began_s: float) -> None:
        """queue_wait, batch_wait, the worker's stages, network (round trip minus worker), overhead (the
        rest: handler code and event-loop waits, e.g. between the result's arrival and this reply),
        scheduler total. Built on the proto directly: this runs for every classify request."""
        worker_us = outcome.worker_total_us
        add = timings.stages.add
        queue_us = seconds_to_us(outcome.queue_wait_s)
        batch_us = seconds_to_us(outcome.batch_wait_s)
        network_us = seconds_to_us(outcome.round_trip_s - worker_us / 1e6)
        total_us = seconds_to_us(self._clock() - began_s)
        add(stage=common_pb2.STAGE_QUEUE_WAIT, duration_us=queue_us, service=SERVICE)
        add(stage=common_pb2.STAGE_BATCH_WAIT, duration_us=batch_us, service=SERVICE)
        add_stages(timings, outcome.worker_stages)
        add(stage=common_pb2.STAGE_NETWORK, duration_us=network_us, service=SERVICE)
        overhead_us = total_us - queue_us - batch_us - network_us - worker_us
        add(stage=common_pb2.STAGE_OVERHEAD, duration_us=max(0, overhead_us), service=SERVICE)
        add(stage=common_pb2.STAGE_SCHEDULER, duration_us=total_us, service=SERVICE)
        timings.total_us = total_us

    def _record_wait_spans(self, job: ClassifyJob, outcome: ClassifyOutcome) -> None:
        now_ns = time.time_ns()
        sent_ns = now_ns - int(outcome.round_trip_s * 1e9)
        ready_ns = sent_ns - int(outcome.batch_wait_s * 1e9)
        enqueued_ns = ready_ns - int(outcome.queue_wait_s * 1e9)
        record_stage_span(_tracer, "queue_wait", enqueued_ns, ready_ns, None)
        record_stage_span(_tracer, "batch_wait", ready_ns, sent_ns, None, {"infermesh.batch_size": outcome.batch_size})

    # -- Generate --------------------------------------------------------------

    @maps_domain_errors
    async def Generate(self, request: scheduler_pb2.ScheduleGenerateRequest,
                       context: Any) -> AsyncIterator[scheduler_pb2.ScheduleGenerateResponse]:
        began_s = self._clock()
        parent = context_from_metadata(context.invocation_metadata())
        bind(request_id=request.request.request_id, tenant=request.tenant.tenant_id)
        with (
            server_span(_tracer, "infermesh.v1.Scheduler/Generate", parent) as span,
            self._metrics.counted(request.request.model.name, request.tenant.tenant_id, "generate", began_s),
        ):
            events: asyncio.Queue[StreamEvent] = asyncio.Queue()
            run = self._admit_generate(request, remaining_s(context), began_s, events, span)
            self._in_flight.stream_began(run)
            try:
                while True:
                    event = await events.get()
                    if event.error is not None:
                        raise event.error
                    assert event.delta is not None  # an event is a delta or an error
                    reply = scheduler_pb2.ScheduleGenerateResponse()
                    run.fill_chunk(reply.chunk, event.delta)
                    yield reply
                    if event.delta.is_last:
                        return
            finally:
                self._in_flight.stream_ended(run)
                run.abort_unless_finished()

    async def generate_call(self, request: scheduler_pb2.ScheduleGenerateRequest, carrier: dict[str, str],
                            remaining_s: float | None, next_chunk: Callable[[], gateway_pb2.GenerateResponse]) -> None:
        """Generate on a Submit stream: the pool's step loop hands each chunk to a callback that builds
        it in the stream's outbox (no await or task per token); this task only waits for the end."""
        began_s = self._clock()
        bind(request_id=request.request.request_id, tenant=request.tenant.tenant_id)
        with (
            server_span(_tracer, "infermesh.v1.Scheduler/Generate", context_from_carrier(carrier)) as span,
            self._metrics.counted(request.request.model.name, request.tenant.tenant_id, "generate", began_s),
        ):
            sink = ChunkSink(next_chunk)
            sink.call = run = self._admit_generate(request, remaining_s, began_s, sink, span)
            self._in_flight.stream_began(run)
            try:
                await sink.done
            finally:
                self._in_flight.stream_ended(run)
                run.abort_unless_finished()

    def _admit_generate(self, request: scheduler_pb2.ScheduleGenerateRequest, remaining_s: float | None,
                        began_s: float, events: EventSink, span: Any) -> GenerateCall:
        """Validate, make the sequence and submit it to the pool; `events` receives its StreamEvents."""
        self._refuse_if_draining()
        req = request.request
        entry, lora_adapter = self.registry.resolve_generator_adapter(req.model.name, req.model.version)
        dimensions = check_task(req, entry.key, entry.hello.embedding)
        stream, prompt_ids, sampling = self._make_stream(req, request.tenant, entry, began_s, remaining_s, events)
        if lora_adapter:
            sampling = dataclasses.replace(sampling, lora_adapter=lora_adapter)
        reasoning = entry.pool.text.reasoning_start(prompt_ids, constrained=bool(sampling.grammar))
        if reasoning.grammar_after is not None and not entry.pool.honours(WorkerFeature.GRAMMAR_AFTER_REASONING):
            # Only workers older than this scheduler serve the model, and one would ignore the field and
            # constrain from the first token anyway: ask for that, and the first chunk says so.
            reasoning = dataclasses.replace(reasoning, grammar_after=None)
        if reasoning.grammar_after is not None:
            sampling = dataclasses.replace(sampling, grammar_after_reasoning=reasoning.grammar_after)
        span.set_attribute("infermesh.model", str(entry.key))
        span.set_attribute("infermesh.tenant", stream.tenant.tenant_id)
        span.set_attribute("infermesh.prompt_tokens", len(prompt_ids))
        delivered = tuple(request.continuation.token_ids)
        if delivered:
            span.set_attribute("infermesh.continued_tokens", len(delivered))
        ttft_target_s = req.objectives.ttft_ms / 1000 if req.objectives.ttft_ms else None
        tpot_target_s = req.objectives.tpot_ms / 1000 if req.objectives.tpot_ms else None
        entry.pool.submit(stream, prompt_ids, sampling, delivered, ttft_target_s, tpot_target_s,
                          ttft_prediction_factor=prediction_factor(request.ttft_prediction_factor))
        return GenerateCall(req.request_id, entry, stream, began_s, span, self._clock, self._metrics.generate_finished,
                            tool_call_parser=entry.pool.text.tool_call_parser if req.tools else "",
                            prompt_token_ids=prompt_ids if req.return_token_ids and not delivered else (),
                            reasoning=reasoning, embedding=(dimensions, entry.hello.embedding.normalize)
                            if entry.hello.embedding is not None else None)

    def _make_stream(self, req: gateway_pb2.GenerateRequest, tenant: scheduler_pb2.TenantContext,
                     entry: GeneratorEntry, began_s: float, remaining_s: float | None,
                     events: EventSink) -> tuple[GenerateStream, tuple[int, ...], SamplingParams]:
        max_seq_len = entry.pool.max_seq_len()
        prompt_ids = truncated_prompt(prompt_token_ids(req, entry.pool.text), req, max_seq_len)
        embed = req.HasField("embed")
        if embed and len(prompt_ids) > max_seq_len:  # a prompt alone, no output: it may fill the context
            raise errors.InvalidArgument(f"prompt of {len(prompt_ids)} tokens is longer than the model's context "
                                         f"of {max_seq_len} tokens")
        if not embed and len(prompt_ids) >= max_seq_len:
            raise errors.InvalidArgument(f"prompt of {len(prompt_ids)} tokens does not fit the model's context of "
                                         f"{max_seq_len} tokens (prompt and output together)")
        max_tokens = req.sampling.max_tokens or min(DEFAULT_MAX_TOKENS, max_seq_len - len(prompt_ids))
        tokenizer = entry.pool.tokenizer
        if embed:  # nothing is sampled: one step reaches the prompt's end and returns the vector
            sampling = SamplingParams(max_tokens=1, embed=True)
        else:
            sampling = decode_sampling(with_model_defaults(req.sampling, req.model_default_fields,
                                                           entry.hello.sampling_defaults),
                                       max_tokens, tokenizer.vocab_size, tokenizer.end_token_ids,
                                       lambda text: tokenizer.encode(text, add_special_tokens=False))
        options = stream_options(req.stream.max_tokens_per_chunk, req.stream.interval_ms)
        if options.coalesces:
            # Coalesced here, not at the gateway, so both hops carry the fewer, larger chunks.
            events = CoalescedEvents(events, ChunkCoalescer(options, self._clock), self._clock,
                                     asyncio.get_running_loop().call_later)
        # A seed drawn here, not by each worker, keeps sampling reproducible across preemption and failover.
        seed = sampling.seed if sampling.seed is not None else random.getrandbits(63)
        stream = GenerateStream(
            seq_id=WorkerLink.next_id(),
            tenant=self._tenants.decode(tenant),
            seed=seed,
            trace_context=carrier_for(),
            arrival_s=began_s,
            deadline_s=_deadline_s(remaining_s, began_s, self._config.deadline_margin_ms / 1000),
            events=events,
        )
        return stream, prompt_ids, sampling

    # -- Submit ----------------------------------------------------------------

    async def Submit(self, request_iterator: Any, context: Any) -> None:
        """Many calls on one stream; submit_stream.SubmitStream routes entries to the cores above."""
        undecodable: list[Undecodable] = []
        read_message = getattr(context, "read_marked", context.read)

        async def read() -> scheduler_pb2.SubmitBatch | None:
            try:
                batch = await read_message()
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
                log.info("Submit stream from %s ended: %s", context.peer(), exc)
                return None
            if isinstance(batch, Undecodable):
                undecodable.append(batch)
                return None
            return None if batch is grpc.aio.EOF else batch

        if self._draining:
            await abort_with(context, draining_error("submit elsewhere"))
        stream = SubmitStream(self, self._config.max_message_bytes)
        self._submit_streams.add(stream)
        try:
            await stream.serve(read, context.write)
        finally:
            self._submit_streams.discard(stream)
        if undecodable:
            # Aborted here, not in the reader task: serve() has stopped the writer (see read_marked).
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, undecodable[0].reason)

    # -- Attach ----------------------------------------------------------------

    async def Attach(self, request_iterator: Any, context: Any) -> None:
        if self._draining:
            # Workers we just drained re-dial at once; they must find another scheduler.
            await abort_with(context, draining_error("attach elsewhere"))
        await self._sessions.serve(context)

    # -- Pressure and models ------------------------------------------------------

    async def GetPressure(self, request: scheduler_pb2.GetPressureRequest,
                          context: Any) -> scheduler_pb2.GetPressureResponse:
        wanted = {(m.name, m.version) for m in request.models}
        response = scheduler_pb2.GetPressureResponse(measured_at_unix_us=int(time.time() * 1e6))
        for entry in self.registry.entries():
            if wanted and (entry.key.name, entry.key.version) not in wanted and (entry.key.name, "") not in wanted:
                continue
            response.models.append(encode_pressure(entry.key, entry.pool.pressure()))
        return response

    async def ListModels(self, request: gateway_pb2.ListModelsRequest, context: Any) -> gateway_pb2.ListModelsResponse:
        response = gateway_pb2.ListModelsResponse()
        for entry in self.registry.entries():
            hello = entry.hello
            response.models.append(
                gateway_pb2.ModelInfo(
                    model=common_pb2.ModelRef(name=entry.key.name, version=entry.key.version),
                    kind=common_pb2.MODEL_KIND_TENSOR if hello.tensor_inputs else KIND_TO_WIRE[entry.kind],
                    # Draining: gateways discovering models stop routing here at once.
                    ready=not self._draining and any(w.usable for w in entry.pool.workers),
                    labels=hello.labels,
                    max_seq_len=hello.capacity.max_seq_len,
                    input_height=hello.input_height,
                    input_width=hello.input_width,
                    batching=self._batching_info(entry),
                    # The worker's TensorMetadata messages (attach_types keeps them opaque).
                    tensor_inputs=cast("list[common_pb2.TensorMetadata]", hello.tensor_inputs),
                    tensor_outputs=cast("list[common_pb2.TensorMetadata]", hello.tensor_outputs),
                    embedding_dimensions=hello.embedding.dimensions if hello.embedding is not None else 0,
                )
            )
        response.models.extend(self._adapter_infos())
        return response

    def _adapter_infos(self) -> list[gateway_pb2.ModelInfo]:
        """Each LoRA adapter as a model of its own, `parent` its base (vLLM's /v1/models)."""
        infos = []
        for name, base in sorted(self.registry.adapters().items()):
            entry = self.registry.get(base)
            if entry is None:
                continue
            workers = [w for w in entry.pool.workers if name in w.hello.lora_adapters]
            infos.append(gateway_pb2.ModelInfo(
                model=common_pb2.ModelRef(name=name, version=base.version), kind=KIND_TO_WIRE[entry.kind],
                ready=not self._draining and any(w.usable for w in workers),
                max_seq_len=entry.hello.capacity.max_seq_len, batching=self._batching_info(entry), parent=base.name))
        return infos

    @maps_domain_errors
    async def Tokenize(self, request: gateway_pb2.TokenizeRequest, context: Any) -> gateway_pb2.TokenizeResponse:
        entry = self.registry.resolve_generator(request.model.name, request.model.version)
        return tokenize(request, entry.key, entry.pool.text, entry.hello.capacity.max_seq_len)

    @maps_domain_errors
    async def Detokenize(self, request: gateway_pb2.DetokenizeRequest, context: Any) -> gateway_pb2.DetokenizeResponse:
        entry = self.registry.resolve_generator(request.model.name, request.model.version)
        return detokenize(request, entry.key, entry.pool.tokenizer)

    @maps_domain_errors
    async def GetTokenizerInfo(self, request: gateway_pb2.GetTokenizerInfoRequest,
                               context: Any) -> gateway_pb2.GetTokenizerInfoResponse:
        entry = self.registry.resolve_generator(request.model.name, request.model.version)
        return tokenizer_info(entry.key, entry.hello.tokenizer, entry.hello.capacity.max_seq_len)

    def _batching_info(self, entry: ModelEntry) -> gateway_pb2.BatchingInfo:
        """The batching in force for a model, as KServe's ModelConfig reports it at the gateway."""
        if isinstance(entry, ClassifierEntry):
            config = entry.pool.batching
            return gateway_pb2.BatchingInfo(max_batch_size=config.max_batch_size,
                                            max_queue_delay_us=round(config.max_queue_delay_s * 1e6),
                                            preferred_batch_sizes=config.preferred_batch_sizes)
        steps = step_scheduler_config(self._config, entry.hello.capacity)
        return gateway_pb2.BatchingInfo(max_batch_size=steps.max_num_seqs,
                                        max_num_batched_tokens=steps.max_num_batched_tokens)

    # -- lifecycle -----------------------------------------------------------------

    def _refuse_if_draining(self) -> None:
        if self._draining:
            raise draining_error("call another scheduler")

    async def drain(self, grace_s: float) -> None:
        """SIGTERM: refuse new calls at once (UNAVAILABLE, pushback 0: the gateway retries elsewhere
        at once); let classify calls finish and streams run up to drain_grace_ms; end the streams
        still running with UNAVAILABLE "scheduler draining: stream handed over" (pushback 0; the
        gateway resumes each elsewhere as a continuation) and free their blocks. Each worker is
        told to re-dial another scheduler as soon as it has nothing left here (the calls refused
        here need it there), all of them at the latest at the end, within grace_s."""
        began_s = self._clock()
        self._draining = True
        for stream in self._submit_streams:
            stream.drain()
        # Some of grace_s is kept for the workers' goodbye and the server's stop after it.
        deadline_s = began_s + grace_s * 0.8
        handover_at_s = min(began_s + self._config.drain_grace_ms / 1000, deadline_s)
        log.info("draining: %d classify calls and %d streams in flight; streams still running in %.2fs are "
                 "handed over", self._in_flight.num_classify, self._in_flight.num_streams, handover_at_s - began_s)
        handed_over = False
        while True:
            self._sessions.release_idle(self._in_flight.num_classify, grace_s)
            now_s = self._clock()
            if not handed_over and self._in_flight.num_streams and now_s >= handover_at_s:
                self._hand_over_streams()
                handed_over = True
                continue  # their sequences are gone: their workers are idle now
            if idle(self._in_flight) or now_s >= deadline_s:
                break
            await self._in_flight.changed((deadline_s if handed_over else handover_at_s) - now_s)
        self._sessions.release_all(grace_s)
        await self._sessions.wait_detached(deadline_s)

    def _hand_over_streams(self) -> None:
        error = draining_error("stream handed over")
        handed_over: dict[str, int] = {}
        for run in self._in_flight.streams:
            if run.hand_over(error):
                handed_over[run.model_name] = handed_over.get(run.model_name, 0) + 1
        for model_name, count in handed_over.items():
            metrics.STREAMS_HANDED_OVER.labels(model_name).inc(count)
        log.info("draining: handed over %d streams", sum(handed_over.values()))


def _tensor_shape(inputs: Sequence[common_pb2.Tensor]) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], int]:
    """A tensor request's batching key, each input's name and dims past the batch dim (by name), and
    its rows (dim 0 of the first input; the worker checks that every input agrees)."""
    key = tuple(sorted((tensor.name, tuple(tensor.shape[1:])) for tensor in inputs))
    first = inputs[0].shape
    return key, (max(1, first[0]) if first else 1)


def _check_payload_fits(key: ModelKey, hello: WorkerHello, is_tensor: bool) -> None:
    """A tensor model takes `inputs`, an image classifier an `image`; the other is refused by name."""
    if is_tensor and not hello.tensor_inputs:
        raise errors.InvalidArgument(f"model {key} is an image classifier: send `image`, not `inputs`")
    if not is_tensor and hello.tensor_inputs:
        names = [getattr(t, "name", "") for t in hello.tensor_inputs]
        raise errors.InvalidArgument(f"model {key} is a tensor model: send its inputs {names} in `inputs`")
