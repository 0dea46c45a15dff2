"""Scheduler gRPC servicer: protobuf <-> pools, domain errors -> statuses."""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import grpc

from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common import errors
from services.common.log_context import bind
from services.common.metric_labels import FirstSeen, KnownValues
from services.common.status import abort as abort_with
from services.common.status import maps_domain_errors, status_code_of
from services.common.stream_options import stream_options
from services.common.telemetry import (
    carrier_for,
    context_from_carrier,
    context_from_metadata,
    record_stage_span,
    server_span,
    tracer,
)
from services.common.timings import StageTime, seconds_to_us, to_proto
from services.scheduler import metrics
from services.scheduler.chunk_coalescer import ChunkCoalescer, CoalescedEvents
from services.scheduler.classify_pool import ClassifyJob
from services.scheduler.config import SchedulerConfig
from services.scheduler.fair_queue import Priority, TenantContext
from services.scheduler.generate_pool import GenerateStream, StreamEvent, step_scheduler_config
from services.scheduler.in_flight import InFlightCalls, draining_error, idle
from services.scheduler.model_registry import ModelEntry, ModelRegistry
from services.scheduler.pressure import ModelPressure
from services.scheduler.sequence import FinishReason, SamplingParams
from services.scheduler.step_plan import SequenceDelta
from services.scheduler.submit_stream import SubmitStream
from services.scheduler.worker_link import WorkerLink

log = logging.getLogger(__name__)
_tracer = tracer("infermesh.scheduler")
PROTOCOL_VERSION = 1
SERVICE = "scheduler"
# Requests that carry no tenant (direct calls, tests) share one queue.
ANONYMOUS_TENANT = "anonymous"
# Generated tokens a request gets when it names no max_tokens (capped by the model's max sequence length).
DEFAULT_MAX_TOKENS = 128
_FINISH_REASONS = {
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.EOS: common_pb2.FINISH_REASON_EOS,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
}


def _deadline_s(remaining_s: float | None, now_s: float, margin_s: float) -> float | None:
    """The call's deadline on this clock; remaining_s: the caller's budget (gRPC deadline or entry timeout)."""
    if remaining_s is None or remaining_s > 1e6:
        return None
    return now_s + remaining_s - margin_s


def _check_hello(hello: scheduler_pb2.WorkerHello) -> None:
    if not hello.worker_id:
        raise errors.InvalidArgument("hello.worker_id is required")
    if not hello.model.name or not hello.model.version:
        raise errors.InvalidArgument("hello.model needs both name and version")
    if hello.kind == common_pb2.MODEL_KIND_UNSPECIFIED:
        raise errors.InvalidArgument("hello.kind is required")
    if hello.protocol_version > PROTOCOL_VERSION:
        raise errors.InvalidArgument(
            f"worker speaks Attach protocol {hello.protocol_version}; this scheduler serves up to {PROTOCOL_VERSION}"
        )
    capacity = hello.capacity
    if hello.kind == common_pb2.MODEL_KIND_GENERATOR and (capacity.num_kv_blocks < 1 or capacity.block_size < 1):
        raise errors.InvalidArgument("a generator worker must declare num_kv_blocks and block_size >= 1")


_KNOWN_PRIORITIES = frozenset(common_pb2.Priority.values())
_tenants: dict[tuple[str, int, int], TenantContext] = {}
_MAX_REMEMBERED_TENANTS = 10_000


def _tenant(context: scheduler_pb2.TenantContext) -> TenantContext:
    key = (context.tenant_id, context.priority, context.weight)
    tenant = _tenants.get(key)
    if tenant is not None:
        return tenant
    if context.priority not in _KNOWN_PRIORITIES:
        raise errors.InvalidArgument(f"tenant.priority {context.priority} is not a known Priority")
    tenant = TenantContext(context.tenant_id or ANONYMOUS_TENANT, Priority.from_wire(context.priority),
                           max(1, context.weight))
    if len(_tenants) >= _MAX_REMEMBERED_TENANTS:
        _tenants.clear()  # tenants come from the gateway's config; this only bounds a misbehaving caller
    _tenants[key] = tenant
    return tenant


def _sampling(sampling: common_pb2.SamplingParams, max_tokens: int) -> SamplingParams:
    if sampling.temperature < 0:
        raise errors.InvalidArgument(f"sampling.temperature must be >= 0, got {sampling.temperature}")
    if not 0 <= sampling.top_p <= 1:
        raise errors.InvalidArgument(f"sampling.top_p must be in [0, 1], got {sampling.top_p}")
    if any(not stop for stop in sampling.stop):
        raise errors.InvalidArgument("sampling.stop must not contain empty strings")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p or 1.0,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop=tuple(sampling.stop),
        ignore_eos=sampling.ignore_eos,
    )


def _pressure_proto(key, pressure: ModelPressure) -> common_pb2.ModelPressure:
    return common_pb2.ModelPressure(
        model=common_pb2.ModelRef(name=key.name, version=key.version),
        est_queue_time_us=pressure.est_queue_time_us_by_priority(),
        queue_depth=pressure.queue_depth,
        kv_usage=pressure.kv_usage,
        num_workers=pressure.num_workers,
        min_service_time_us=seconds_to_us(pressure.min_service_time_s),
        num_slots=pressure.num_slots,
    )


class _Outcome:
    """The status code a request ended with, for requests_total."""

    code = "OK"


class _GenerateRun:
    """One admitted sequence: its stream in the pool, and what its chunks carry (both transports)."""

    __slots__ = ("_servicer", "_request_id", "_entry", "stream", "_began_s", "_span", "_model", "_first")

    def __init__(self, servicer: SchedulerServicer, request_id: str, entry, stream: GenerateStream,
                 began_s: float, span) -> None:
        self._servicer = servicer
        self._request_id = request_id
        self._entry = entry
        self.stream = stream
        self._began_s = began_s
        self._span = span
        self._model = common_pb2.ModelRef(name=entry.key.name, version=entry.key.version)
        self._first = True

    def fill_chunk(self, chunk: gateway_pb2.GenerateResponse, delta: SequenceDelta) -> None:
        """Builds delta's chunk in place; the first names the model, the last carries usage and timings."""
        chunk.request_id = self._request_id
        chunk.token_ids.extend(delta.token_ids)
        chunk.text = delta.text
        chunk.index = delta.index
        chunk.finish_reason = _FINISH_REASONS.get(delta.finish_reason, common_pb2.FINISH_REASON_UNSPECIFIED)
        if self._first:
            chunk.model.CopyFrom(self._model)
            self._first = False
        if delta.is_last:
            self._servicer._finish_chunk(chunk, delta, self.stream, self._began_s, self._model)
            self._span.set_attribute("infermesh.completion_tokens", delta.num_generated)

    @property
    def model_name(self) -> str:
        return self._entry.key.name

    def hand_over(self, error: errors.Unavailable) -> bool:
        """The scheduler drains: end the stream with `error` for the caller to resume elsewhere."""
        handed_over = self._entry.pool.hand_over(self.stream, error)
        if handed_over:
            self._span.set_attribute("infermesh.handed_over", True)
        return handed_over

    def abort_unless_finished(self) -> None:
        """The caller went away (or the call failed): drop the sequence and free its KV blocks now."""
        if not self.stream.finished:
            self._entry.pool.abort(self.stream)
        if isinstance(self.stream.events, CoalescedEvents):
            self.stream.events.close()  # no interval timer may outlive the call


class _ChunkSink:
    """Stands in for GenerateStream.events on a Submit stream: the pool's `put_nowait(event)` builds
    the chunk at once in the stream's outbox, so a step's chunks cost no await or task per token."""

    __slots__ = ("_next_chunk", "run", "done")

    def __init__(self, next_chunk: Callable[[], gateway_pb2.GenerateResponse]) -> None:
        self._next_chunk = next_chunk
        self.run: _GenerateRun | None = None
        # Resolves with the last chunk, or fails with the error that ends the sequence.
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()

    def put_nowait(self, event: StreamEvent) -> None:
        if self.done.done():
            return
        if event.error is not None:
            self.done.set_exception(event.error)
            return
        self.run.fill_chunk(self._next_chunk(), event.delta)
        if event.delta.is_last:
            self.done.set_result(None)


# Distinct tenant ids that get their own series; the rest are counted as "_other".
MAX_TENANT_LABELS = 256


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, config: SchedulerConfig, clock=time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self.registry = ModelRegistry(config)
        self._links: set[WorkerLink] = set()
        self._submit_streams: set[SubmitStream] = set()
        self._scheduler_id = f"scheduler-{uuid.uuid4().hex[:8]}"
        self._metric_children: dict[tuple, object] = {}
        # Label values from requests stay bounded (services/common/metric_labels.py): models this
        # scheduler has served, and the first tenant ids its gateways sent.
        self._model_label = KnownValues(self.registry.knows)
        self._tenant_label = FirstSeen(MAX_TENANT_LABELS)
        self._draining = False
        self._in_flight: InFlightCalls[_GenerateRun] = InFlightCalls()

    # -- Classify --------------------------------------------------------------

    @maps_domain_errors
    async def Classify(self, request: scheduler_pb2.ScheduleClassifyRequest, context) -> scheduler_pb2.ScheduleClassifyResponse:
        reply = scheduler_pb2.ScheduleClassifyResponse()
        parent = context_from_metadata(context.invocation_metadata())
        await self._classify(request, parent, context.time_remaining(), lambda: reply.response)
        return reply

    def classify_call(self, request: scheduler_pb2.ScheduleClassifyRequest, carrier: dict[str, str],
                      remaining_s: float | None, respond) -> Awaitable[None]:
        """Classify on a Submit stream: the same core, the response built in the stream's outbox."""
        return self._classify(request, context_from_carrier(carrier), remaining_s, respond)

    async def _classify(self, request: scheduler_pb2.ScheduleClassifyRequest, parent, remaining_s: float | None,
                        respond: Callable[[], gateway_pb2.ClassifyResponse]) -> None:
        """Validate, queue for the batcher, await the worker; `respond()` gives the message to fill
        (built in place: this runs for every classify request)."""
        began_s = self._clock()
        bind(request_id=request.request.request_id, tenant=request.tenant.tenant_id)
        with (
            server_span(_tracer, "infermesh.v1.Scheduler/Classify", parent) as span,
            self._counted(request.request.model.name, request.tenant.tenant_id, "classify", began_s),
        ):
            self._refuse_if_draining()
            req = request.request
            if not req.HasField("image") or req.image.WhichOneof("data") is None:
                raise errors.InvalidArgument("image is required (encoded bytes or raw pixels)")
            entry = self.registry.resolve(req.model, common_pb2.MODEL_KIND_CLASSIFIER)
            num_labels = len(entry.hello.labels)
            if num_labels and req.top_k > num_labels:
                raise errors.InvalidArgument(f"top_k {req.top_k} exceeds the {num_labels} classes of {entry.key}")
            span.set_attribute("infermesh.model", str(entry.key))
            span.set_attribute("infermesh.tenant", request.tenant.tenant_id)
            job = ClassifyJob(
                request=req,
                tenant=_tenant(request.tenant),
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
            response.labels.extend(outcome.labels)
            self._classify_timings(response.timings, outcome, began_s)

    def _classify_timings(self, timings: common_pb2.Timings, outcome, began_s: float) -> None:
        """queue_wait, batch_wait, the worker's stages, network (round trip minus worker), overhead (the
        rest: handler code and event-loop waits, e.g. between the result's arrival and this reply),
        scheduler total. Built on the proto directly: this runs for every classify request."""
        worker = outcome.worker_timings
        add = timings.stages.add
        queue_us = seconds_to_us(outcome.queue_wait_s)
        batch_us = seconds_to_us(outcome.batch_wait_s)
        network_us = seconds_to_us(outcome.round_trip_s - worker.total_us / 1e6)
        total_us = seconds_to_us(self._clock() - began_s)
        add(stage=common_pb2.STAGE_QUEUE_WAIT, duration_us=queue_us, service=SERVICE)
        add(stage=common_pb2.STAGE_BATCH_WAIT, duration_us=batch_us, service=SERVICE)
        timings.stages.extend(worker.stages)
        add(stage=common_pb2.STAGE_NETWORK, duration_us=network_us, service=SERVICE)
        overhead_us = total_us - queue_us - batch_us - network_us - worker.total_us
        add(stage=common_pb2.STAGE_OVERHEAD, duration_us=max(0, overhead_us), service=SERVICE)
        add(stage=common_pb2.STAGE_SCHEDULER, duration_us=total_us, service=SERVICE)
        timings.total_us = total_us

    def _record_wait_spans(self, job: ClassifyJob, outcome) -> None:
        now_ns = time.time_ns()
        sent_ns = now_ns - int(outcome.round_trip_s * 1e9)
        ready_ns = sent_ns - int(outcome.batch_wait_s * 1e9)
        enqueued_ns = ready_ns - int(outcome.queue_wait_s * 1e9)
        record_stage_span(_tracer, "queue_wait", enqueued_ns, ready_ns, None)
        record_stage_span(_tracer, "batch_wait", ready_ns, sent_ns, None, {"infermesh.batch_size": outcome.batch_size})

    # -- Generate --------------------------------------------------------------

    @maps_domain_errors
    async def Generate(self, request: scheduler_pb2.ScheduleGenerateRequest, context):
        began_s = self._clock()
        parent = context_from_metadata(context.invocation_metadata())
        bind(request_id=request.request.request_id, tenant=request.tenant.tenant_id)
        with (
            server_span(_tracer, "infermesh.v1.Scheduler/Generate", parent) as span,
            self._counted(request.request.model.name, request.tenant.tenant_id, "generate", began_s),
        ):
            events = asyncio.Queue()
            run = self._admit_generate(request, context.time_remaining(), began_s, events, span)
            self._in_flight.stream_began(run)
            try:
                while True:
                    event = await events.get()
                    if event.error is not None:
                        raise event.error
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
            self._counted(request.request.model.name, request.tenant.tenant_id, "generate", began_s),
        ):
            sink = _ChunkSink(next_chunk)
            sink.run = run = self._admit_generate(request, remaining_s, began_s, sink, span)
            self._in_flight.stream_began(run)
            try:
                await sink.done
            finally:
                self._in_flight.stream_ended(run)
                run.abort_unless_finished()

    def _admit_generate(self, request: scheduler_pb2.ScheduleGenerateRequest, remaining_s: float | None,
                        began_s: float, events, span) -> _GenerateRun:
        """Validate, make the sequence and submit it to the pool; `events` receives its StreamEvents."""
        self._refuse_if_draining()
        req = request.request
        entry = self.registry.resolve(req.model, common_pb2.MODEL_KIND_GENERATOR)
        stream, prompt_ids, sampling = self._make_stream(req, request.tenant, entry, began_s, remaining_s, events)
        span.set_attribute("infermesh.model", str(entry.key))
        span.set_attribute("infermesh.tenant", stream.tenant.tenant_id)
        span.set_attribute("infermesh.prompt_tokens", len(prompt_ids))
        delivered = tuple(request.continuation.token_ids)
        if delivered:
            span.set_attribute("infermesh.continued_tokens", len(delivered))
        entry.pool.submit(stream, prompt_ids, sampling, delivered)
        return _GenerateRun(self, req.request_id, entry, stream, began_s, span)

    def _make_stream(self, req: gateway_pb2.GenerateRequest, tenant: scheduler_pb2.TenantContext, entry,
                     began_s: float, remaining_s: float | None,
                     events) -> tuple[GenerateStream, tuple[int, ...], SamplingParams]:
        if not req.prompt:
            raise errors.InvalidArgument("prompt must not be empty")
        prompt_ids = entry.pool.tokenizer.encode(req.prompt)
        max_tokens = req.sampling.max_tokens or max(1, min(DEFAULT_MAX_TOKENS, entry.pool.max_seq_len() - len(prompt_ids)))
        sampling = _sampling(req.sampling, max_tokens)
        options = stream_options(req.stream.max_tokens_per_chunk, req.stream.interval_ms)
        if options.coalesces:
            # Coalesced here, not at the gateway, so both hops carry the fewer, larger chunks.
            events = CoalescedEvents(events, ChunkCoalescer(options, self._clock), self._clock,
                                     asyncio.get_running_loop().call_later)
        sampling_proto = req.sampling
        if not sampling_proto.HasField("seed"):
            # A seed drawn here, not by each worker, keeps sampling reproducible across preemption and failover.
            sampling_proto = common_pb2.SamplingParams()
            sampling_proto.CopyFrom(req.sampling)
            sampling_proto.seed = random.getrandbits(63)
        stream = GenerateStream(
            seq_id=WorkerLink.next_id(),
            tenant=_tenant(tenant),
            sampling_proto=sampling_proto,
            trace_context=carrier_for(),
            arrival_s=began_s,
            deadline_s=_deadline_s(remaining_s, began_s, self._config.deadline_margin_ms / 1000),
            events=events,
        )
        return stream, prompt_ids, sampling

    def _finish_chunk(self, chunk: gateway_pb2.GenerateResponse, delta: SequenceDelta, stream: GenerateStream,
                      began_s: float, model) -> None:
        now_s = self._clock()
        chunk.model.CopyFrom(model)
        chunk.usage.prompt_tokens = delta.num_prompt_tokens
        chunk.usage.completion_tokens = delta.num_generated
        first_token_s = stream.seq.first_token_s if stream.seq is not None and stream.seq.first_token_s else now_s
        chunk.ttft_us = seconds_to_us(first_token_s - began_s)
        scheduled_s = stream.first_scheduled_s or began_s
        queue_us = seconds_to_us(scheduled_s - began_s)
        compute_us = seconds_to_us(stream.compute_s)
        total_us = seconds_to_us(now_s - began_s)
        stages = [
            StageTime("queue_wait", queue_us, SERVICE),
            StageTime("compute", compute_us, "worker"),
            # Steps' network, scheduling and waits for the rest of each step's batch.
            StageTime("overhead", max(0, total_us - queue_us - compute_us), SERVICE),
            StageTime("scheduler", total_us, SERVICE),
        ]
        chunk.timings.CopyFrom(to_proto(stages, total_us=seconds_to_us(now_s - began_s)))
        self._child(metrics.E2E_LATENCY, model.name, "generate").observe(now_s - began_s)

    @contextmanager
    def _counted(self, model_name: str, tenant_id: str, kind: str, began_s: float) -> Iterator[_Outcome]:
        """Counts the request by its final status (requests_total) and times successful classify replies."""
        outcome = _Outcome()
        try:
            yield outcome
        except errors.InfermeshError as exc:
            outcome.code = status_code_of(exc).name
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome.code = "CANCELLED"
            raise
        except Exception:
            outcome.code = "INTERNAL"
            raise
        finally:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s %r finished: %s", kind, model_name, outcome.code)
            model_label = self._model_label(model_name)
            self._child(metrics.REQUESTS, model_label, self._tenant_label(tenant_id or ANONYMOUS_TENANT),
                        outcome.code).inc()
            if kind == "classify" and outcome.code == "OK":
                self._child(metrics.E2E_LATENCY, model_label, kind).observe(self._clock() - began_s)

    def _child(self, metric, *labels: str):
        """metric.labels(*labels), remembered: the lookup takes a lock and is paid per request."""
        key = (metric, labels)
        child = self._metric_children.get(key)
        if child is None:
            child = self._metric_children[key] = metric.labels(*labels)
        return child

    # -- Submit ----------------------------------------------------------------

    async def Submit(self, request_iterator, context):
        """Many calls on one stream; submit_stream.SubmitStream routes entries to the cores above."""
        async def read() -> scheduler_pb2.SubmitBatch | None:
            try:
                batch = await context.read()
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
                log.info("Submit stream from %s ended: %s", context.peer(), exc)
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

    # -- Attach ----------------------------------------------------------------

    async def Attach(self, request_iterator, context):
        if self._draining:
            # Workers we just drained re-dial at once; they must find another scheduler.
            await abort_with(context, draining_error("attach elsewhere"))
        first = await context.read()
        if first is grpc.aio.EOF or first.WhichOneof("kind") != "hello":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first Attach message must be hello")
        try:
            _check_hello(first.hello)
            link = WorkerLink(first.hello)
            self.registry.attach(link)
        except errors.InfermeshError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
        self._links.add(link)
        welcome = scheduler_pb2.Welcome(
            scheduler_id=self._scheduler_id, heartbeat_interval_ms=self._config.heartbeat_interval_ms
        )
        reader = asyncio.create_task(self._read_worker(link, context))
        try:
            await context.write(scheduler_pb2.SchedulerCommand(welcome=welcome))
            while (command := await link.next_command()) is not None:
                await context.write(command)
        finally:
            reader.cancel()
            link.close()
            self._links.discard(link)
            self.registry.detach(link)
        if reader.done() and not reader.cancelled() and reader.exception() is not None:
            raise reader.exception()  # e.g. the abort for an undecodable message: the call ends with it

    async def _read_worker(self, link: WorkerLink, context) -> None:
        # A watchdog, not a timeout per read: wrapping every read in wait_for costs a task per message.
        watchdog = asyncio.create_task(self._watch_silence(link, context))
        try:
            while True:
                message = await context.read()
                if message is grpc.aio.EOF:
                    break
                link.last_heard_s = self._clock()
                self._on_worker_message(link, message)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            log.warning("worker %s stream failed: %s", link.worker_id, exc)
        finally:
            watchdog.cancel()
            # Whatever ended the reading, Attach's writer must stop and detach the worker: a reader that
            # died on an exception without this left a ghost worker taking batches until restart.
            link.close()

    async def _watch_silence(self, link: WorkerLink, context) -> None:
        timeout_s = self._config.worker_timeout_ms / 1000
        link.last_heard_s = self._clock()
        while True:
            silent_s = self._clock() - link.last_heard_s
            if silent_s >= timeout_s:
                log.warning("worker %s silent for %.1fs; treating it as gone", link.worker_id, silent_s)
                link.close()  # ends the writer; Attach's cleanup detaches the worker
                return
            await asyncio.sleep(timeout_s - silent_s)

    def _on_worker_message(self, link: WorkerLink, message: scheduler_pb2.WorkerMessage) -> None:
        kind = message.WhichOneof("kind")
        if kind == "batch_result":
            link.on_result(message.batch_result.batch_id, message.batch_result)
        elif kind == "step_result":
            link.on_result(message.step_result.step_id, message.step_result)
        elif kind == "heartbeat":
            link.kv_blocks_used = message.heartbeat.num_kv_blocks_used
        elif kind == "draining":
            log.info("worker %s is draining", link.worker_id)
            self.registry.draining(link)
        if link.draining and link.hello.kind == common_pb2.MODEL_KIND_CLASSIFIER and link.num_in_flight == 0:
            link.end_stream()

    # -- Pressure and models ------------------------------------------------------

    async def GetPressure(self, request: scheduler_pb2.GetPressureRequest, context) -> scheduler_pb2.GetPressureResponse:
        wanted = {(m.name, m.version) for m in request.models}
        response = scheduler_pb2.GetPressureResponse(measured_at_unix_us=int(time.time() * 1e6))
        for entry in self.registry.entries():
            if wanted and (entry.key.name, entry.key.version) not in wanted and (entry.key.name, "") not in wanted:
                continue
            response.models.append(_pressure_proto(entry.key, entry.pool.pressure()))
        return response

    async def ListModels(self, request: gateway_pb2.ListModelsRequest, context) -> gateway_pb2.ListModelsResponse:
        response = gateway_pb2.ListModelsResponse()
        for entry in self.registry.entries():
            hello = entry.hello
            response.models.append(
                gateway_pb2.ModelInfo(
                    model=common_pb2.ModelRef(name=entry.key.name, version=entry.key.version),
                    kind=entry.kind,
                    # Draining: gateways discovering models stop routing here at once.
                    ready=not self._draining and any(w.usable for w in entry.pool.workers),
                    labels=hello.labels,
                    max_seq_len=hello.capacity.max_seq_len,
                    input_height=hello.input_height,
                    input_width=hello.input_width,
                    batching=self._batching_info(entry),
                )
            )
        return response

    def _batching_info(self, entry: ModelEntry) -> gateway_pb2.BatchingInfo:
        """The batching in force for a model, as KServe's ModelConfig reports it at the gateway."""
        if entry.kind == common_pb2.MODEL_KIND_CLASSIFIER:
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
        released: set[WorkerLink] = set()
        handed_over = False
        while True:
            self._release_idle_workers(released, grace_s)
            now_s = self._clock()
            if not handed_over and self._in_flight.num_streams and now_s >= handover_at_s:
                self._hand_over_streams()
                handed_over = True
                continue  # their sequences are gone: their workers are idle now
            if idle(self._in_flight) or now_s >= deadline_s:
                break
            await self._in_flight.changed((deadline_s if handed_over else handover_at_s) - now_s)
        for link in list(self._links):
            if link not in released:
                self._release(link, grace_s)
        while self._links and self._clock() < deadline_s:
            await asyncio.sleep(0.05)

    def _release_idle_workers(self, released: set[WorkerLink], grace_s: float) -> None:
        """Tells each worker with nothing left here (no classify call in flight for a classifier, no
        sequence for a generator) to re-dial another scheduler."""
        for link in list(self._links):
            if link in released:
                continue
            if link.hello.kind == common_pb2.MODEL_KIND_CLASSIFIER:
                idle_here = self._in_flight.num_classify == 0
            else:
                entry = self.registry.get(link.model)
                idle_here = entry is None or entry.pool.num_sequences_on(link) == 0
            if idle_here:
                self._release(link, grace_s)
                released.add(link)

    def _release(self, link: WorkerLink, grace_s: float) -> None:
        self.registry.draining(link)
        link.drain(int(grace_s * 1000))

    def _hand_over_streams(self) -> None:
        error = draining_error("stream handed over")
        handed_over: dict[str, int] = {}
        for run in self._in_flight.streams:
            if run.hand_over(error):
                handed_over[run.model_name] = handed_over.get(run.model_name, 0) + 1
        for model_name, count in handed_over.items():
            metrics.STREAMS_HANDED_OVER.labels(model_name).inc(count)
        log.info("draining: handed over %d streams", sum(handed_over.values()))

