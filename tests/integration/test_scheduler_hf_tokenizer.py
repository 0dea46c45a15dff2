"""A TOKENIZER_KIND_HF worker through a real scheduler process: its tokenizer.json crosses the Attach
stream in pieces, the scheduler encodes prompts with it and streams the worker's ids as text.

The worker is scripted here (this file's thread): it declares the byte-level BPE the unit tests train,
records the prompt ids each sequence's steps carry, and samples a fixed multi-script continuation
whose characters its tokens split, then EOS.
"""

from __future__ import annotations

import hashlib
import queue
import threading

import grpc
import pytest
from tokenizers import Tokenizer as RustTokenizer

from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common.protocol import ATTACH_PROTOCOL_VERSION, TOKENIZER_FILE_CHUNK_BYTES
from tests.unit.scheduler.hf_tokenizer_files import byte_level_json
from tests.unit.scheduler.test_chat_template import LLAMA3
from tools.testbed import session_tls
from tools.testbed.processes import running_mesh
from tools.testbed.scheduler_fixtures import read_stream, scheduler_stub, tenant, wait_for_workers

pytestmark = pytest.mark.integration

MODEL = common_pb2.ModelRef(name="hf-scripted", version="1")
CONTINUATION = " Grüße aus Köln 🙂🚀 東京は日本の首都です。"
PIECE_BYTES = 4096  # small pieces, so the file takes many messages
CHAT_MODEL = common_pb2.ModelRef(name="hf-scripted-chat", version="1")
SPECIAL_TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
# Llama 3.1's template (its BOS written by the template itself), less today's date: the scheduler
# process renders on its own clock.
TODAY_LINE = """{{- "Today Date: " + strftime_now("%d %b %Y") + "\\n\\n" }}\n"""
assert TODAY_LINE in LLAMA3
CHAT_TEMPLATE = LLAMA3.replace(TODAY_LINE, "")


class ScriptedHFWorker:
    def __init__(self, address: str, tokenizer_json: bytes, model: common_pb2.ModelRef = MODEL,
                 chat_template: str = "", worker_id: str = "", features: tuple[int, ...] = (),
                 reasoning_parser: str = "") -> None:
        """`features`: WorkerHello.features (none: a worker older than WorkerFeature)."""
        self._address = address
        self._worker_id = worker_id or f"scripted-{model.name}"
        self._features = features
        self._reasoning_parser = reasoning_parser
        self._json = tokenizer_json
        self._model = model
        self._chat_template = chat_template
        rust = RustTokenizer.from_str(tokenizer_json.decode())
        self.eos = rust.token_to_id("<|eot_id|>")
        self.outputs = [*rust.encode(CONTINUATION, add_special_tokens=False).ids, self.eos]
        self.vocab_size = rust.get_vocab_size(with_added_tokens=True)
        self.prompts: dict[int, list[int]] = {}  # seq_id -> the ids its steps carried, in order
        self.steps: dict[int, scheduler_pb2.SequenceStep] = {}  # seq_id -> its last step
        self._replies: queue.Queue = queue.Queue()
        self._channel = session_tls.channel(address, identity="worker").__enter__()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._replies.put(None)
        self._channel.close()
        self._thread.join(timeout=5)

    def _messages(self):
        assert TOKENIZER_FILE_CHUNK_BYTES >= PIECE_BYTES
        yield scheduler_pb2.WorkerMessage(hello=scheduler_pb2.WorkerHello(
            worker_id=self._worker_id, model=self._model, kind=common_pb2.MODEL_KIND_GENERATOR,
            features=self._features,
            capacity=scheduler_pb2.WorkerCapacity(num_kv_blocks=64, block_size=16, max_seq_len=512, max_num_seqs=4),
            protocol_version=ATTACH_PROTOCOL_VERSION,
            tokenizer=scheduler_pb2.TokenizerSpec(
                kind=scheduler_pb2.TOKENIZER_KIND_HF, vocab_size=self.vocab_size + 3, eos_token_id=self.eos,
                tokenizer_json_sha256=hashlib.sha256(self._json).hexdigest(),
                tokenizer_json_size_bytes=len(self._json),
                special_tokens=SPECIAL_TOKENS, chat_template=self._chat_template,
                reasoning_parser=self._reasoning_parser)))
        for at in range(0, len(self._json), PIECE_BYTES):
            yield scheduler_pb2.WorkerMessage(tokenizer_file=scheduler_pb2.TokenizerFile(
                data=self._json[at:at + PIECE_BYTES]))
        while True:
            try:
                reply = self._replies.get(timeout=0.5)
            except queue.Empty:
                yield scheduler_pb2.WorkerMessage(heartbeat=scheduler_pb2.Heartbeat())
                continue
            if reply is None:
                return
            yield reply

    def _serve(self) -> None:
        try:
            for command in scheduler_pb2_grpc.SchedulerStub(self._channel).Attach(self._messages()):
                if command.WhichOneof("kind") == "run_step":
                    self._replies.put(scheduler_pb2.WorkerMessage(step_result=self._step(command.run_step)))
        except grpc.RpcError:
            pass  # the test closed the channel

    def _step(self, step: scheduler_pb2.RunStep) -> scheduler_pb2.StepResult:
        result = scheduler_pb2.StepResult(step_id=step.step_id)
        for seq in step.seqs:
            self.prompts.setdefault(seq.seq_id, []).extend(seq.token_ids)
            self.steps[seq.seq_id] = seq
            if seq.sample:
                result.outputs.add(seq_id=seq.seq_id, token_id=self.outputs[seq.num_generated])
        return result


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with running_mesh(tmp_path_factory.mktemp("scheduler-hf")) as mesh:
        mesh.start_scheduler()
        worker = ScriptedHFWorker(mesh.scheduler.address, byte_level_json())
        chat_worker = ScriptedHFWorker(mesh.scheduler.address, byte_level_json(), CHAT_MODEL, CHAT_TEMPLATE)
        try:
            with scheduler_stub(mesh.scheduler.address) as stub:
                wait_for_workers(stub, MODEL, 1)
                wait_for_workers(stub, CHAT_MODEL, 1)
            mesh.worker, mesh.chat_worker = worker, chat_worker
            yield mesh
        finally:
            worker.close()
            chat_worker.close()


def generate(stub, prompt: str = "", stop: tuple[str, ...] = (), model: common_pb2.ModelRef = MODEL,
             messages: tuple[dict[str, str], ...] = ()):
    request = scheduler_pb2.ScheduleGenerateRequest(
        request=gateway_pb2.GenerateRequest(model=model, prompt=prompt, sampling=common_pb2.SamplingParams(
            max_tokens=100, stop=stop), messages=[gateway_pb2.ChatMessage(**m) for m in messages]),
        tenant=tenant("tests"))
    return read_stream(stub.Generate(request, timeout=10))


CONVERSATION = ({"role": "system", "content": "Antworte kurz."}, {"role": "user", "content": "Grüße 🙂, wie geht's?"},
                {"role": "assistant", "content": "Gut!"}, {"role": "user", "content": "東京は？"})


def test_messages_reach_the_worker_as_transformers_apply_chat_template_ids(mesh, monkeypatch):
    transformers = pytest.importorskip("transformers")
    rust = RustTokenizer.from_str(byte_level_json().decode())
    reference = transformers.PreTrainedTokenizerFast(tokenizer_object=rust, chat_template=CHAT_TEMPLATE,
                                                     **SPECIAL_TOKENS)
    before = set(mesh.chat_worker.prompts)
    with scheduler_stub(mesh.scheduler.address) as stub:
        record = generate(stub, model=CHAT_MODEL, messages=CONVERSATION)
    expected = reference.apply_chat_template(list(CONVERSATION), tokenize=True, add_generation_prompt=True,
                                             return_dict=False)
    assert record.text == CONTINUATION and record.finish_reason == common_pb2.FINISH_REASON_EOS
    (seq_id,) = set(mesh.chat_worker.prompts) - before
    assert mesh.chat_worker.prompts[seq_id][: len(expected)] == list(expected)
    assert mesh.chat_worker.prompts[seq_id][len(expected):] == mesh.chat_worker.outputs[:-1]


def test_a_model_without_a_chat_template_refuses_messages_and_still_takes_prompts(mesh):
    with scheduler_stub(mesh.scheduler.address) as stub:
        with pytest.raises(grpc.RpcError) as caught:
            generate(stub, messages=({"role": "user", "content": "hi"},))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details() == ("this model has no chat template, so it cannot answer chat; "
                                          "send a prompt (completions) instead of messages")
        assert generate(stub, "hi").text == CONTINUATION


def test_a_prompt_longer_than_the_context_names_both_lengths(mesh):
    rust = RustTokenizer.from_str(byte_level_json().decode())
    prompt = "Grüße aus Köln 🙂 " * 60
    num_tokens = len(rust.encode(prompt).ids)
    assert num_tokens > 512
    with scheduler_stub(mesh.scheduler.address) as stub, pytest.raises(grpc.RpcError) as caught:
        generate(stub, prompt)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == (f"prompt of {num_tokens} tokens does not fit the model's context of 512 tokens "
                                      "(prompt and output together)")


def test_prompt_is_encoded_with_the_workers_tokenizer_and_ids_stream_as_whole_characters(mesh):
    rust = RustTokenizer.from_str(byte_level_json().decode())
    before = set(mesh.worker.prompts)
    with scheduler_stub(mesh.scheduler.address) as stub:
        record = generate(stub, "Grüße 🙂, wie geht's?")
    assert record.text == CONTINUATION
    assert record.finish_reason == common_pb2.FINISH_REASON_EOS
    assert record.num_tokens == len(mesh.worker.outputs) - 1  # EOS ends the stream and is not streamed
    (seq_id,) = set(mesh.worker.prompts) - before
    prompt_ids = rust.encode("Grüße 🙂, wie geht's?").ids  # BOS from tokenizer.json's post-processor
    assert mesh.worker.prompts[seq_id][: len(prompt_ids)] == prompt_ids
    assert mesh.worker.prompts[seq_id][len(prompt_ids):] == mesh.worker.outputs[:-1]  # each sample fed back, not EOS


def test_a_stop_string_that_begins_inside_a_token_ends_the_text_right_before_it(mesh):
    rust = RustTokenizer.from_str(byte_level_json().decode())
    stop = "ße aus K"
    starts = set()
    text = b""
    for token in mesh.worker.outputs:
        starts.add(len(text))
        text += rust.decode([token]).encode()
    assert len(CONTINUATION[: CONTINUATION.index(stop)].encode()) not in starts  # it does begin inside a token
    with scheduler_stub(mesh.scheduler.address) as stub:
        record = generate(stub, "Hallo", stop=(stop,))
    assert record.text == CONTINUATION[: CONTINUATION.index(stop)]
    assert record.finish_reason == common_pb2.FINISH_REASON_STOP
