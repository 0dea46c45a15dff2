"""A TOKENIZER_KIND_HF worker attaches: tokenizer.json follows its hello in pieces, the scheduler
checks and builds it before welcome, and refuses what cannot serve with INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
import hashlib

import grpc
import pytest

from infermesh.v1 import common_pb2, scheduler_pb2
from services.common.errors import InvalidArgument
from services.common.protocol import TOKENIZER_FILE_CHUNK_BYTES
from services.scheduler.attach_session import AttachSessions
from services.scheduler.config import SchedulerConfig
from services.scheduler.hf_tokenizer import HFTokenizer
from services.scheduler.model_registry import ModelRegistry
from services.scheduler.tokenizer_file import TokenizerFileAssembly

from .hf_tokenizer_files import byte_level_json, num_ids, sentencepiece_json
from .test_chat_template import CHATML

TEMPLATE_SPECIALS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>"}


class Aborted(Exception):
    pass


class FakeAttach:
    """The worker's side of one Attach stream: what it sends, what the scheduler answers."""

    def __init__(self, messages) -> None:
        self._messages: asyncio.Queue = asyncio.Queue()
        for message in messages:
            self._messages.put_nowait(message)
        self.written: list = []
        self.welcomed = asyncio.Event()
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    async def read(self):
        return await self._messages.get()

    async def write(self, message) -> None:
        self.written.append(message)
        self.welcomed.set()

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise Aborted(details)

    def end(self) -> None:
        self._messages.put_nowait(grpc.aio.EOF)


def hello(worker_id: str = "w1", js: bytes | None = None, protocol_version: int = 2, **spec) -> scheduler_pb2.WorkerMessage:
    js = byte_level_json() if js is None else js
    fields = dict(kind=scheduler_pb2.TOKENIZER_KIND_HF, vocab_size=num_ids(js) + 4, eos_token_id=num_ids(js) - 2,
                  tokenizer_json_sha256=hashlib.sha256(js).hexdigest(), tokenizer_json_size_bytes=len(js),
                  special_tokens=TEMPLATE_SPECIALS, chat_template=CHATML)
    fields.update(spec)
    return scheduler_pb2.WorkerMessage(hello=scheduler_pb2.WorkerHello(
        worker_id=worker_id, model=common_pb2.ModelRef(name="m", version="1"), kind=common_pb2.MODEL_KIND_GENERATOR,
        capacity=scheduler_pb2.WorkerCapacity(num_kv_blocks=8, block_size=16, max_seq_len=256),
        protocol_version=protocol_version, tokenizer=scheduler_pb2.TokenizerSpec(**fields)))


def pieces(js: bytes, sizes=(1000, 1, 5000)) -> list[scheduler_pb2.WorkerMessage]:
    out, at = [], 0
    for size in (*sizes, len(js)):
        if at < len(js):
            out.append(scheduler_pb2.WorkerMessage(tokenizer_file=scheduler_pb2.TokenizerFile(data=js[at:at + size])))
            at += size
    return out


@pytest.fixture
async def sessions():
    registry = ModelRegistry(SchedulerConfig())
    yield AttachSessions(registry, "s1", heartbeat_interval_ms=1000, worker_timeout_ms=5000, clock=lambda: 0.0)
    tasks = asyncio.all_tasks() - {asyncio.current_task()}  # the pools' loops, sessions left open
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def attach(sessions: AttachSessions, *messages) -> FakeAttach:
    """Runs the session until welcome or abort; the stream stays open (a worker attached)."""
    worker = FakeAttach(messages)
    serving = asyncio.create_task(sessions.serve(worker))
    welcomed = asyncio.create_task(worker.welcomed.wait())
    await asyncio.wait({serving, welcomed}, return_when=asyncio.FIRST_COMPLETED)
    if serving.done() and isinstance(serving.exception(), Aborted):
        welcomed.cancel()
    return worker


def pool_of(sessions: AttachSessions):
    return sessions._registry.resolve_generator("m", "1").pool


async def test_the_file_in_pieces_builds_the_models_tokenizer_and_template_before_welcome(sessions):
    js = byte_level_json()
    worker = await attach(sessions, hello(), *pieces(js))
    assert worker.aborted is None and worker.written[0].WhichOneof("kind") == "welcome"
    pool = pool_of(sessions)
    assert isinstance(pool.tokenizer, HFTokenizer)
    assert pool.tokenizer.sha256 == hashlib.sha256(js).hexdigest()
    ids = pool.text.chat_prompt_ids([{"role": "user", "content": "Grüße 🙂"}])
    assert pool.tokenizer.decode(ids) == "system\nYou are a helpful assistant.\nuser\nGrüße 🙂\nassistant\n"


async def test_the_hellos_stop_ids_end_sequences_as_eos_does(sessions):
    js = byte_level_json()
    eos = num_ids(js) - 2
    worker = await attach(sessions, hello(stop_token_ids=[4, num_ids(js) + 1]), *pieces(js))
    assert worker.aborted is None
    assert pool_of(sessions).tokenizer.end_token_ids == {eos, 4, num_ids(js) + 1}


async def test_a_stop_id_outside_the_vocabulary_is_refused(sessions):
    js = byte_level_json()
    worker = await attach(sessions, hello(stop_token_ids=[num_ids(js) + 4]), *pieces(js))
    assert worker.aborted is not None and worker.aborted[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert f"stop_token_ids [{num_ids(js) + 4}] are outside the vocabulary" in worker.aborted[1]


async def test_a_further_worker_of_the_version_reuses_the_built_tokenizer(sessions):
    await attach(sessions, hello("w1"), *pieces(byte_level_json()))
    text = pool_of(sessions).text
    worker = await attach(sessions, hello("w2"), *pieces(byte_level_json(), sizes=(TOKENIZER_FILE_CHUNK_BYTES,)))
    assert worker.aborted is None
    assert pool_of(sessions).text is text and len(pool_of(sessions).workers) == 2


async def test_a_further_worker_with_another_tokenizer_is_refused_naming_what_differs(sessions):
    await attach(sessions, hello("w1"), *pieces(byte_level_json()))
    js = sentencepiece_json()
    worker = await attach(sessions, hello("w2", js, eos_token_id=2, special_tokens={"bos_token": "<s>"}), *pieces(js))
    assert worker.aborted is not None
    code, details = worker.aborted
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("worker w2 declares another tokenizer for m:1 than attached workers (differs in "
                              "vocab_size, eos_token_id, tokenizer_json_sha256, tokenizer_json_size_bytes, "
                              "special_tokens)")


@pytest.mark.parametrize("case, message", [
    ("wrong sha256", "tokenizer.json's sha256 is "),
    ("ends early", "tokenizer.json ended after 1000 of "),
    ("another message", "a TOKENIZER_KIND_HF hello must be followed by tokenizer_file messages until tokenizer.json "
                        "is whole; got heartbeat"),
    ("protocol 1", "TOKENIZER_KIND_HF needs Attach protocol 2; the worker speaks 1"),
    ("no size", "hello.tokenizer.tokenizer_json_size_bytes must be in [1, 134217728], got 0"),
    ("vocab too small", "worker w1: tokenizer.json has ids up to "),
    ("bad template", "worker w1: chat template line 1: "),
    ("missing special", "worker w1: tokenizer_config.json bos_token '<bos>' is not a token of tokenizer.json"),
    ("unknown kind", "hello.tokenizer.kind is not one this scheduler serves"),
])
async def test_what_cannot_serve_is_refused_before_welcome_with_a_precise_message(sessions, case, message):
    js = byte_level_json()
    messages = {
        "wrong sha256": [hello(tokenizer_json_sha256="0" * 64), *pieces(js)],
        "ends early": [hello(), *pieces(js)[:1], grpc.aio.EOF],
        "another message": [hello(), *pieces(js)[:1], scheduler_pb2.WorkerMessage(heartbeat=scheduler_pb2.Heartbeat())],
        "protocol 1": [hello(protocol_version=1), *pieces(js)],
        "no size": [hello(tokenizer_json_size_bytes=0)],
        "vocab too small": [hello(vocab_size=100), *pieces(js)],
        "bad template": [hello(chat_template="{% if %}"), *pieces(js)],
        "missing special": [hello(special_tokens={"bos_token": "<bos>"}), *pieces(js)],
        "unknown kind": [hello(kind=7)],
    }[case]
    worker = await attach(sessions, *messages)
    assert worker.aborted is not None and worker.written == []
    code, details = worker.aborted
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(message), details
    with pytest.raises(Exception, match="no worker|not served|unknown|has no version"):
        pool_of(sessions)


def test_pieces_must_be_non_empty_within_the_limit_and_the_declared_size():
    assembly = TokenizerFileAssembly(10, "0" * 64)
    with pytest.raises(InvalidArgument, match="must hold 1 to 1048576 bytes, got 0"):
        assembly.add(b"")
    assembly.add(b"12345678")
    with pytest.raises(InvalidArgument, match="exceed the declared tokenizer_json_size_bytes 10"):
        assembly.add(b"abc")
    with pytest.raises(InvalidArgument, match="64 lowercase hex digits"):
        TokenizerFileAssembly(10, "ABC")
