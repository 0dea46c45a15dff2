"""Attach streams: one worker's session (hello check, writer, reader, heartbeat watchdog) and the
set of them a draining scheduler releases.

A session reads protobuf, hands domain objects (attach_codec.py) to the worker's `WorkerLink`
and the registry, and writes the link's commands as they come. It ends when the worker goes
away (EOF, a broken stream, silence past `worker_timeout_ms`) or is done draining; either way
the link is closed and the worker detached, so its pools re-queue or recompute its work.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, Protocol

import grpc

from infermesh.v1 import scheduler_pb2
from services.common import errors
from services.common.clock import Clock
from services.common.protocol import ATTACH_PROTOCOL_VERSION, HF_TOKENIZER_PROTOCOL_VERSION
from services.common.request_decoding import Undecodable
from services.scheduler import attach_codec
from services.scheduler.attach_types import ModelKind, WorkerHello
from services.scheduler.model_registry import GeneratorEntry, ModelRegistry
from services.scheduler.model_text import ModelText, build_model_text
from services.scheduler.tokenizer_file import TokenizerFileAssembly, check_declared
from services.scheduler.tokenizer_spec import TokenizerKind, TokenizerSpec
from services.scheduler.worker_link import WorkerLink

log = logging.getLogger(__name__)


class AttachContext(Protocol):
    """What a session needs of grpc.aio's ServicerContext."""

    async def read(self) -> Any: ...

    async def write(self, message: Any) -> None: ...

    async def abort(self, code: grpc.StatusCode, details: str) -> None: ...


def check_hello(hello: WorkerHello) -> None:
    """A hello the scheduler can serve, else InvalidArgument naming what is wrong."""
    if not hello.worker_id:
        raise errors.InvalidArgument("hello.worker_id is required")
    if not hello.model.name or not hello.model.version:
        raise errors.InvalidArgument("hello.model needs both name and version")
    if hello.kind is None:
        raise errors.InvalidArgument("hello.kind is required")
    if hello.protocol_version > ATTACH_PROTOCOL_VERSION:
        raise errors.InvalidArgument(
            f"worker speaks Attach protocol {hello.protocol_version}; "
            f"this scheduler serves up to {ATTACH_PROTOCOL_VERSION}"
        )
    capacity = hello.capacity
    if hello.kind is ModelKind.GENERATOR and (capacity.num_kv_blocks < 1 or capacity.block_size < 1):
        raise errors.InvalidArgument("a generator worker must declare num_kv_blocks and block_size >= 1")
    if hello.kind is ModelKind.GENERATOR:
        _check_tokenizer(hello)
    if hello.embedding is not None and hello.embedding.dimensions < 1:
        raise errors.InvalidArgument("a MODEL_KIND_EMBEDDING worker must declare embedding.dimensions >= 1")


def _check_tokenizer(hello: WorkerHello) -> None:
    spec = hello.tokenizer
    if spec.kind is None:
        raise errors.InvalidArgument("hello.tokenizer.kind is not one this scheduler serves "
                                     "(TOKENIZER_KIND_BYTES, TOKENIZER_KIND_HF)")
    if spec.kind is TokenizerKind.HF:
        if hello.protocol_version < HF_TOKENIZER_PROTOCOL_VERSION:
            raise errors.InvalidArgument(f"TOKENIZER_KIND_HF needs Attach protocol {HF_TOKENIZER_PROTOCOL_VERSION}; "
                                         f"the worker speaks {hello.protocol_version}")
        check_declared(spec.tokenizer_json_size_bytes, spec.tokenizer_json_sha256)


async def _read_tokenizer_file(spec: TokenizerSpec, context: AttachContext) -> bytes:
    assembly = TokenizerFileAssembly(spec.tokenizer_json_size_bytes, spec.tokenizer_json_sha256)
    while not assembly.complete:
        message = await context.read()
        if message is grpc.aio.EOF:
            break
        if message.WhichOneof("kind") != "tokenizer_file":
            raise errors.InvalidArgument(f"a TOKENIZER_KIND_HF hello must be followed by tokenizer_file messages "
                                         f"until tokenizer.json is whole; got {message.WhichOneof('kind')}")
        assembly.add(message.tokenizer_file.data)
    return assembly.file()


class AttachSessions:
    """Every attached worker's session, and how a drain releases them."""

    def __init__(self, registry: ModelRegistry, scheduler_id: str, heartbeat_interval_ms: int,
                 worker_timeout_ms: int, clock: Clock) -> None:
        self._registry = registry
        self._scheduler_id = scheduler_id
        self._heartbeat_interval_ms = heartbeat_interval_ms
        self._worker_timeout_s = worker_timeout_ms / 1000
        self._clock = clock
        self._links: set[WorkerLink] = set()
        self._released: set[WorkerLink] = set()

    async def serve(self, context: AttachContext) -> None:
        """One Attach call, from hello to the end of the stream."""
        link = await self._attach(context)
        self._links.add(link)
        reader = asyncio.create_task(self._read(link, context))
        try:
            await context.write(attach_codec.welcome(self._scheduler_id, self._heartbeat_interval_ms))
            while (command := await link.next_command()) is not None:
                await context.write(attach_codec.encode_command(command))
        finally:
            reader.cancel()
            link.close()
            self._links.discard(link)
            self._released.discard(link)
            self._registry.detach(link)
        if reader.done() and not reader.cancelled():
            if (failure := reader.exception()) is not None:
                raise failure
            if (undecodable := reader.result()) is not None:
                # Aborted here, not in the reader: this task has stopped writing (see read_marked).
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, undecodable.reason)

    async def _attach(self, context: AttachContext) -> WorkerLink:
        first = await context.read()
        if first is grpc.aio.EOF or first.WhichOneof("kind") != "hello":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first Attach message must be hello")
        try:
            hello = attach_codec.decode_hello(first.hello)
            check_hello(hello)
            if hello.kind is ModelKind.GENERATOR:
                hello = replace(hello, text=await self._model_text(hello, context))
            link = WorkerLink(hello)
            self._registry.attach(link)
        except errors.InfermeshError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
            raise  # abort() raises; this only tells the type checker
        return link

    async def _model_text(self, hello: WorkerHello, context: AttachContext) -> ModelText:
        """The generator's tokenizer and chat template: the attached version's when the worker
        declares the same (nothing rebuilt), else built off the event loop from the hello and,
        for HF, the tokenizer.json that follows it."""
        spec = hello.tokenizer
        tokenizer_json = b""
        if spec.kind is TokenizerKind.HF:
            try:
                async with asyncio.timeout(self._worker_timeout_s):  # a worker stalling mid-file is gone
                    tokenizer_json = await _read_tokenizer_file(spec, context)
            except TimeoutError:
                raise errors.InvalidArgument(f"tokenizer.json did not arrive within worker_timeout_ms "
                                             f"({self._worker_timeout_s * 1000:.0f})") from None
        self._registry.check_compatible(hello)  # before building: a conflict is the clearer message
        if (attached := self._registry.model_text(hello.model, spec)) is not None:
            return attached
        try:
            if spec.kind is TokenizerKind.HF:
                return await asyncio.to_thread(build_model_text, spec, tokenizer_json)
            return build_model_text(spec)
        except ValueError as exc:  # TokenizerRefused, ChatTemplateInvalid: they name file, field and values
            raise errors.InvalidArgument(f"worker {hello.worker_id}: {exc}") from None

    async def _read(self, link: WorkerLink, context: AttachContext) -> Undecodable | None:
        """Reads until the stream ends; returns the undecodable message that ended it, if one did."""
        # A watchdog, not a timeout per read: wrapping every read in wait_for costs a task per message.
        watchdog = asyncio.create_task(self._watch_silence(link))
        read = getattr(context, "read_marked", context.read)
        try:
            while True:
                message = await read()
                if isinstance(message, Undecodable):
                    return message
                if message is grpc.aio.EOF:
                    break
                link.last_heard_s = self._clock()
                self._on_message(link, message)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            log.warning("worker %s stream failed: %s", link.worker_id, exc)
        finally:
            watchdog.cancel()
            # Whatever ended the reading, the writer must stop and detach the worker: a reader that
            # died on an exception without this left a ghost worker taking batches until restart.
            link.close()
        return None

    async def _watch_silence(self, link: WorkerLink) -> None:
        timeout_s = self._worker_timeout_s
        link.last_heard_s = self._clock()
        while True:
            silent_s = self._clock() - link.last_heard_s
            if silent_s >= timeout_s:
                log.warning("worker %s silent for %.1fs; treating it as gone", link.worker_id, silent_s)
                link.close()  # ends the writer; serve()'s cleanup detaches the worker
                return
            await asyncio.sleep(timeout_s - silent_s)

    def _on_message(self, link: WorkerLink, message: scheduler_pb2.WorkerMessage) -> None:
        kind = message.WhichOneof("kind")
        if kind == "step_result":
            link.on_result(message.step_result.step_id, attach_codec.decode_step_result(message.step_result))
        elif kind == "step_results":
            for result in message.step_results.results:
                link.on_result(result.step_id, attach_codec.decode_step_result(result))
        elif kind == "batch_result":
            link.on_result(message.batch_result.batch_id, attach_codec.decode_batch_result(message.batch_result))
        elif kind == "heartbeat":
            link.kv_blocks_used = message.heartbeat.num_kv_blocks_used
        elif kind == "draining":
            log.info("worker %s is draining", link.worker_id)
            self._registry.draining(link)
        if link.draining and link.hello.kind is ModelKind.CLASSIFIER and link.num_in_flight == 0:
            link.end_stream()

    # -- drain -------------------------------------------------------------------

    @property
    def num_attached(self) -> int:
        return len(self._links)

    def release_idle(self, num_classify_in_flight: int, grace_s: float) -> None:
        """Tells each worker with nothing left here (no classify call in flight for a classifier, no
        sequence for a generator) to re-dial another scheduler."""
        for link in list(self._links):
            if link not in self._released and self._idle(link, num_classify_in_flight):
                self._release(link, grace_s)

    def release_all(self, grace_s: float) -> None:
        for link in list(self._links):
            if link not in self._released:
                self._release(link, grace_s)

    async def wait_detached(self, deadline_s: float, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                            poll_s: float = 0.05) -> None:
        """Until every worker has ended its stream, or deadline_s on the clock."""
        while self._links and self._clock() < deadline_s:
            await sleep(poll_s)

    def _idle(self, link: WorkerLink, num_classify_in_flight: int) -> bool:
        if link.hello.kind is ModelKind.CLASSIFIER:
            return num_classify_in_flight == 0
        entry = self._registry.get(link.model)
        return not isinstance(entry, GeneratorEntry) or entry.pool.num_sequences_on(link) == 0

    def _release(self, link: WorkerLink, grace_s: float) -> None:
        self._registry.draining(link)
        link.drain(int(grace_s * 1000))
        self._released.add(link)
