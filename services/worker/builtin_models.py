"""Two toy models that need no weights: for tests of the mesh's plumbing and quick local runs.

toy-classifier: labels an image "dark" or "bright" by its mean brightness.
toy-generator:  byte-level; each next token is the byte after the previous one
                within 'a'..'z' (so "abc" continues "defg..."), never EOS.
"""

from __future__ import annotations

import time

import numpy as np

from infermesh.v1 import common_pb2, scheduler_pb2
from services.common.errors import InvalidArgument
from services.common.protocol import ATTACH_PROTOCOL_VERSION as PROTOCOL_VERSION
from services.common.timings import StageTime, seconds_to_us, to_proto
from services.worker.image_decode import decode_image  # Pillow only once an encoded image comes
from services.worker.work import ErrorCode, RawImage

INVALID_ARGUMENT = ErrorCode.INVALID_ARGUMENT.value
NO_IMAGE_DATA = "image has neither encoded nor raw data"
MAX_IMAGE_PIXELS = 4096 * 4096
BYTE_VOCAB_SIZE = 257  # 256 bytes + EOS
BYTE_EOS = 256


def item_error(item_id: int, message: str, code: ErrorCode = ErrorCode.INVALID_ARGUMENT) -> scheduler_pb2.ItemResult:
    """One item's failure in a batch's result: the batch's other items are still answered."""
    return scheduler_pb2.ItemResult(item_id=item_id, error=scheduler_pb2.ItemError(code=code, message=message))


def _pixels(image: common_pb2.Image) -> np.ndarray:
    """Its grey levels, `uint8[height, width, 1]`; InvalidArgument naming what is wrong with it."""
    kind = image.WhichOneof("data")
    if kind is None:
        raise InvalidArgument(NO_IMAGE_DATA)
    if kind == "raw":
        raw = image.raw
        return decode_image(RawImage(raw.pixels, raw.height, raw.width, raw.channels), channels=1,
                            max_image_pixels=MAX_IMAGE_PIXELS)
    return decode_image(image.encoded, channels=1, max_image_pixels=MAX_IMAGE_PIXELS)


class ToyClassifierRuntime:
    labels = ("dark", "bright")

    def __init__(self, version: str, max_batch_size: int = 8, compute_ms: float = 0.0) -> None:
        self._version = version
        self._max_batch_size = max_batch_size or 8
        self._compute_s = compute_ms / 1000

    def load(self) -> None:
        golden = common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes([255] * 4), height=2, width=2, channels=1))
        result = self.execute_batch(scheduler_pb2.ExecuteBatch(items=[scheduler_pb2.BatchItem(item_id=1, image=golden)]))
        if result.items[0].labels[0].label != "bright":
            raise RuntimeError("toy-classifier failed its golden check")

    def hello(self, worker_id: str) -> scheduler_pb2.WorkerHello:
        return scheduler_pb2.WorkerHello(
            worker_id=worker_id,
            model=common_pb2.ModelRef(name="toy-classifier", version=self._version),
            kind=common_pb2.MODEL_KIND_CLASSIFIER,
            capacity=scheduler_pb2.WorkerCapacity(max_batch_size=self._max_batch_size, device="cpu"),
            labels=list(self.labels),
            input_height=8,
            input_width=8,
            max_image_pixels=MAX_IMAGE_PIXELS,
            protocol_version=PROTOCOL_VERSION,
        )

    def execute_batch(self, command: scheduler_pb2.ExecuteBatch) -> scheduler_pb2.BatchResult:
        began = time.perf_counter()
        results = []
        for item in command.items:
            try:
                brightness = float(_pixels(item.image).mean()) / 255
            except InvalidArgument as exc:
                results.append(item_error(item.item_id, str(exc)))
                continue
            scores = sorted(zip((1 - brightness, brightness), range(2), strict=True), reverse=True)
            top_k = max(1, min(item.top_k or 1, 2))
            labels = [common_pb2.Label(label=self.labels[i], index=i, score=s) for s, i in scores[:top_k]]
            results.append(scheduler_pb2.ItemResult(item_id=item.item_id, labels=labels))
        if self._compute_s:
            time.sleep(self._compute_s)
        elapsed = seconds_to_us(time.perf_counter() - began)
        return scheduler_pb2.BatchResult(
            batch_id=command.batch_id,
            items=results,
            timings=to_proto([StageTime("compute", elapsed, "worker")], total_us=elapsed),
        )


class ToyGeneratorRuntime:
    def __init__(self, version: str, num_kv_blocks: int = 256, compute_ms: float = 0.0) -> None:
        self._version = version
        self._num_kv_blocks = num_kv_blocks or 256
        self._compute_s = compute_ms / 1000
        self._blocks: dict[int, list[int]] = {}

    def load(self) -> None:
        step = scheduler_pb2.RunStep(seqs=[scheduler_pb2.SequenceStep(seq_id=1, token_ids=list(b"abc"), sample=True,
                                                                         new_blocks=[0], reset_block_table=True)])
        if self.run_step(step).outputs[0].token_id != ord("d"):
            raise RuntimeError("toy-generator failed its golden check")
        self._blocks.clear()

    def hello(self, worker_id: str) -> scheduler_pb2.WorkerHello:
        return scheduler_pb2.WorkerHello(
            worker_id=worker_id,
            model=common_pb2.ModelRef(name="toy-generator", version=self._version),
            kind=common_pb2.MODEL_KIND_GENERATOR,
            capacity=scheduler_pb2.WorkerCapacity(
                num_kv_blocks=self._num_kv_blocks,
                block_size=16,
                max_seq_len=512,
                max_num_seqs=32,
                max_num_batched_tokens=512,
                device="cpu",
            ),
            tokenizer=scheduler_pb2.TokenizerSpec(
                kind=scheduler_pb2.TOKENIZER_KIND_BYTES, vocab_size=BYTE_VOCAB_SIZE, eos_token_id=BYTE_EOS,
                bos_token_id=-1,
            ),
            protocol_version=PROTOCOL_VERSION,
        )

    def run_step(self, command: scheduler_pb2.RunStep) -> scheduler_pb2.StepResult:
        began = time.perf_counter()
        for seq_id in command.finished_seq_ids:
            self._blocks.pop(seq_id, None)
        result = scheduler_pb2.StepResult(step_id=command.step_id)
        outputs = result.outputs
        for seq in command.seqs:
            if seq.reset_block_table:
                self._blocks[seq.seq_id] = []
            self._blocks.setdefault(seq.seq_id, []).extend(seq.new_blocks)
            if not seq.sample:
                continue
            last = seq.token_ids[-1] if seq.token_ids else ord("a")
            letter = last - ord("a") if ord("a") <= last <= ord("z") else -1
            token = common_pb2.TokenLogprob(token_id=ord("a") + (letter + 1) % 26)  # certain: logprob 0
            output = outputs.add(seq_id=seq.seq_id, token_id=token.token_id)
            if seq.sampling.logprobs:
                output.logprobs.token.CopyFrom(token)
                if seq.sampling.top_logprobs:
                    output.logprobs.top.append(token)
        if self._compute_s:
            time.sleep(self._compute_s)
        elapsed = seconds_to_us(time.perf_counter() - began)
        result.timings.CopyFrom(to_proto([StageTime("compute", elapsed, "worker")], total_us=elapsed))
        return result

    def abort(self, command: scheduler_pb2.Abort) -> None:
        for seq_id in command.seq_ids:
            self._blocks.pop(seq_id, None)

    def forget_all(self) -> None:
        self._blocks.clear()

    def kv_blocks_used(self) -> int:
        return sum(len(blocks) for blocks in self._blocks.values())


TOY_MODELS: dict[str, type[ToyClassifierRuntime] | type[ToyGeneratorRuntime]] = {
    "toy-classifier": ToyClassifierRuntime, "toy-generator": ToyGeneratorRuntime}
