"""A server that is not ours, for the load harness to measure beside the mesh: Ray Serve serving our
repository's models, batching whole requests with `@serve.batch` (the peer issues 33, 34 and 37 name).

    .venv-rayserve/bin/python -m bench.harness.ray_serve_peer --port PORT [--model-repo model_repo]
        [--max-batch-size 32] [--batch-wait-ms 5] [--temp-dir DIR]

Run with the Ray venv's python (tests/support/ray_peer.py builds it: `ray[serve]` from PyPI, the
project and its .venv's packages such as torch reached through a .pth file). On 127.0.0.1:PORT:

    /v1/models, /v1/completions, /v1/chat/completions   OpenAI API for tinylm, streamed (SSE) or whole;
                                                         usage on the last event, no stage timings
    /v2/health/ready, /v2/models/digits[/versions/1]/ready, .../infer
                                                         KServe v2 REST for digits: IMAGE as BYTES [1, 1]
                                                         (PNG) or UINT8 [1, H, W, C], JSON or the binary
                                                         tensor extension; PROBABILITIES FP32 [1, classes]

Each model is a Ray Serve deployment (one replica) that loads it the way our worker does
(`load_model`, one torch thread) and runs it with the worker's own code: tinylm's steps are
StepExecutor.run, digits' batches BatchExecutor.execute. What differs from the mesh is the batching:
`@serve.batch` forms a batch of up to --max-batch-size waiting requests (waiting at most
--batch-wait-ms for it to fill) only when the previous batch has ended; a generation batch
prefills its members together, then decodes them together until the longest is done (request-level
batching, as issue 33's peer). Generation ignores EOS, so outputs have exactly `max_tokens` tokens.

Prints `READY <port>` on stdout once both applications answer; SIGTERM or SIGINT shuts Serve and
the local Ray cluster down.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import json
import os
import signal
import struct
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

GENERATOR = "tinylm"
CLASSIFIER = "digits"
VERSION = "1"
HEADER_LENGTH = "Inference-Header-Content-Length"


@dataclass(frozen=True)
class Generation:
    """One completion request as the batch handler sees it."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float
    seed: int | None


@serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
class OpenAIPeer:
    def __init__(self, model_repo: str, max_batch_size: int, batch_wait_s: float) -> None:
        from services.worker.repository.loader import load_model
        from services.worker.step_executor import StepExecutor
        from services.worker.thread_settings import set_library_threads

        set_library_threads(1)
        model = load_model(model_repo, GENERATOR, VERSION)
        envelope, spec = model.manifest.envelope, model.manifest.generator
        self._executor = StepExecutor(model.generator, envelope.num_kv_blocks, envelope.block_size)
        self._bos = spec.tokenizer.bos_token_id
        self._vocab_bytes = 256  # byte-level: ids below 256 are bytes, above are specials
        self._next_seq_id = 1
        self._step_id = 0
        self._warm_up()
        self.steps.set_max_batch_size(max_batch_size)
        self.steps.set_batch_wait_timeout_s(batch_wait_s)

    async def __call__(self, request: Request) -> Response:
        path = request.url.path.rstrip("/")
        if request.method == "GET" and path.endswith("/models"):
            return JSONResponse({"object": "list", "data": [{"id": GENERATOR, "object": "model", "owned_by": "ray"}]})
        if request.method != "POST" or not path.endswith(("/completions", "/chat/completions")):
            return JSONResponse({"error": {"message": f"no route {request.method} {path}"}}, status_code=404)
        body = await request.json()
        chat = path.endswith("/chat/completions")
        prompt = "".join(m.get("content", "") for m in body.get("messages", ())) if chat else body.get("prompt", "")
        if body.get("model") != GENERATOR or not isinstance(prompt, str) or not prompt:
            return JSONResponse({"error": {"message": f"model must be {GENERATOR!r} with a prompt"}}, status_code=400)
        seed = body.get("seed")
        generation = Generation(((self._bos,) if self._bos >= 0 else ()) + tuple(prompt.encode()),
                                int(body.get("max_tokens") or 16), float(body.get("temperature") or 0.0),
                                int(seed) if seed is not None else None)
        reply = _Reply(chat, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", len(generation.prompt_ids))
        if body.get("stream"):
            return StreamingResponse(self._events(generation, reply), media_type="text/event-stream")
        texts = [text async for text in self._texts(generation, reply)]
        return JSONResponse(reply.whole("".join(texts)))

    async def _texts(self, generation: Generation, reply: _Reply) -> AsyncIterator[str]:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        async for token_id in self.steps(generation):
            reply.num_tokens += 1
            yield decoder.decode(bytes([token_id]) if token_id < self._vocab_bytes else b"")
        yield decoder.decode(b"", final=True)

    async def _events(self, generation: Generation, reply: _Reply) -> AsyncIterator[bytes]:
        async for text in self._texts(generation, reply):
            if text:
                yield _event(reply.chunk(text, None))
        yield _event(reply.chunk("", "length"))
        yield _event(reply.usage_chunk())
        yield b"data: [DONE]\n\n"

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)
    async def steps(self, batch: list[Generation]) -> AsyncIterator[list]:
        """Prefill every member in one step, then decode together; each slot gets its token per step,
        then StopIteration once it has max_tokens."""
        from services.worker.work import RunStep, SamplingParams, SequenceStep

        seq_ids = [self._new_seq_id() for _ in batch]
        size, next_block, steps = self._executor.block_size, 0, []
        for seq_id, g in zip(seq_ids, batch, strict=True):
            num_blocks = -(-(len(g.prompt_ids) + g.max_tokens) // size)  # every member's whole length, up front
            steps.append(SequenceStep(seq_id, g.prompt_ids, 0, new_blocks=tuple(range(next_block, next_block + num_blocks)),
                                      reset_block_table=True, sample=True,
                                      sampling=SamplingParams(temperature=g.temperature, seed=g.seed)))
            next_block += num_blocks
        generated = [0] * len(batch)
        try:
            while steps:
                outputs, _ = self._executor.run(RunStep(step_id=self._step_id, seqs=tuple(steps)))
                self._step_id += 1
                tokens: dict[int, int] = {o.seq_id: o.token_id for o in outputs if o.token_id is not None}
                slots: list = []
                next_steps = []
                for i, (seq_id, g) in enumerate(zip(seq_ids, batch, strict=True)):
                    if generated[i] >= g.max_tokens:
                        slots.append(StopIteration)
                        continue
                    token_id = tokens[seq_id]
                    generated[i] += 1
                    slots.append(token_id)
                    if generated[i] < g.max_tokens:
                        next_steps.append(SequenceStep(seq_id, (token_id,), len(g.prompt_ids) + generated[i] - 1,
                                                       sample=True, num_generated=generated[i],
                                                       sampling=SamplingParams(temperature=g.temperature, seed=g.seed)))
                yield slots
                # Let the callers' streams send this step's tokens before the next step blocks the loop
                # (without it every token of the batch would leave at its end).
                await asyncio.sleep(0)
                steps = next_steps
            yield [StopIteration] * len(batch)
        finally:
            self._executor.forget(seq_ids)

    def _warm_up(self) -> None:
        """One prefill before the replica is ready, as the worker warms up before it attaches."""
        from services.worker.work import RunStep, SequenceStep

        self._executor.run(RunStep(step_id=0, seqs=(SequenceStep(0, (self._bos, 104, 105), 0, new_blocks=(0,),
                                                                 reset_block_table=True, sample=True),)))
        self._executor.forget([0])
        self._step_id = 1

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1


class _Reply:
    """The OpenAI objects of one completion (completions or chat), whole or as stream chunks."""

    def __init__(self, chat: bool, reply_id: str, num_prompt_tokens: int) -> None:
        self.chat, self.reply_id, self.num_prompt_tokens = chat, reply_id, num_prompt_tokens
        self.num_tokens = 0
        self.created_s = int(time.time())

    def usage(self) -> dict:
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": self.num_tokens,
                "total_tokens": self.num_prompt_tokens + self.num_tokens}

    def whole(self, text: str) -> dict:
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if self.chat
                  else {"index": 0, "text": text})
        return {"id": self.reply_id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created_s, "model": GENERATOR,
                "choices": [{**choice, "finish_reason": "length"}], "usage": self.usage()}

    def chunk(self, text: str, finish_reason: str | None) -> dict:
        choice = {"index": 0, "delta": {"content": text} if text else {}} if self.chat else {"index": 0, "text": text}
        return {"id": self.reply_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created_s, "model": GENERATOR, "choices": [{**choice, "finish_reason": finish_reason}]}

    def usage_chunk(self) -> dict:
        return {"id": self.reply_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created_s, "model": GENERATOR, "choices": [], "usage": self.usage()}


def _event(value: dict) -> bytes:
    return b"data: " + json.dumps(value, separators=(",", ":")).encode() + b"\n\n"


@serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
class KServePeer:
    def __init__(self, model_repo: str, max_batch_size: int, batch_wait_s: float) -> None:
        from services.worker.batch_executor import BatchExecutor
        from services.worker.repository.loader import load_model
        from services.worker.thread_settings import set_library_threads

        set_library_threads(1)
        classifier = load_model(model_repo, CLASSIFIER, VERSION).classifier
        self._executor = BatchExecutor(classifier, max_batch_size=max_batch_size)
        self._num_classes = len(classifier.labels)
        from services.worker.work import BatchItem, RawImage

        # The preprocessing kernel compiles on first use (seconds): before the replica is ready, not on a request.
        self._executor.execute([BatchItem(0, RawImage(bytes(28 * 28), 28, 28, 1))])
        self.classify.set_max_batch_size(max_batch_size)
        self.classify.set_batch_wait_timeout_s(batch_wait_s)

    async def __call__(self, request: Request) -> Response:
        parts = request.url.path.strip("/").split("/")  # v2, models, NAME, [versions, V], VERB
        if parts == ["v2", "health", "ready"] or parts == ["v2", "health", "live"]:
            return JSONResponse({"ready": True})
        if len(parts) < 3 or parts[:2] != ["v2", "models"] or parts[2] != CLASSIFIER:
            return JSONResponse({"error": f"no model at {request.url.path}"}, status_code=404)
        verb = parts[-1] if len(parts) in (4, 6) else ""
        if verb == "ready":
            return JSONResponse({"name": CLASSIFIER, "ready": True})
        if verb != "infer" or request.method != "POST":
            return JSONResponse({"name": CLASSIFIER, "versions": [VERSION], "platform": "ray-serve"})
        try:
            image = _image_input(await request.body(), request.headers.get(HEADER_LENGTH))
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        result = await self.classify(image)
        if result.error is not None:
            return JSONResponse({"error": result.error.message}, status_code=400)
        scores = [0.0] * self._num_classes
        for label in result.labels:
            scores[label.index] = label.score
        return JSONResponse({"model_name": CLASSIFIER, "model_version": VERSION, "outputs": [
            {"name": "PROBABILITIES", "datatype": "FP32", "shape": [1, self._num_classes], "data": scores}]})

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)
    async def classify(self, images: list) -> list:
        from services.worker.work import BatchItem

        results, _ = self._executor.execute([BatchItem(i, image, top_k=self._num_classes)
                                             for i, image in enumerate(images)])
        return results


def _image_input(body: bytes, header_length: str | None):
    """The IMAGE input of a KServe v2 REST body: PNG bytes (BYTES [1, 1]) or a RawImage (UINT8 [1, H, W, C])."""
    from services.worker.work import RawImage

    length = int(header_length) if header_length else len(body)
    document = json.loads(body[:length])
    (spec,) = [i for i in document.get("inputs", ()) if i.get("name") == "IMAGE"] or [None]
    if spec is None:
        raise ValueError("the request has no IMAGE input")
    binary = (spec.get("parameters") or {}).get("binary_data_size")
    data = body[length:length + binary] if binary is not None else None
    shape = spec.get("shape") or []
    if spec.get("datatype") == "BYTES":
        if data is None:
            return bytes(spec["data"][0], "latin-1") if isinstance(spec["data"][0], str) else bytes(spec["data"][0])
        (size,) = struct.unpack_from("<I", data)
        return data[4:4 + size]
    if spec.get("datatype") == "UINT8" and len(shape) == 4:
        pixels = data if data is not None else bytes(spec["data"])
        return RawImage(pixels, shape[1], shape[2], shape[3])
    raise ValueError(f"IMAGE must be BYTES [1, 1] or UINT8 [1, H, W, C], got {spec.get('datatype')} {shape}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-repo", default="model_repo")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--batch-wait-ms", type=float, default=5.0)
    parser.add_argument("--temp-dir", default="", help="Ray's session files (default: Ray's own, /tmp/ray)")
    args = parser.parse_args()
    # Nothing leaves the machine (Ray's usage statistics are sent home by default), and a local
    # cluster of one process tree needs no token written to the home directory.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    model_repo = os.path.abspath(args.model_repo)
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 1024 * 1024, logging_level="WARNING",
             log_to_driver=False, _temp_dir=args.temp_dir or None,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}})
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port}, logging_config={"log_level": "WARNING"})
        wait_s = args.batch_wait_ms / 1000
        serve.run(OpenAIPeer.bind(model_repo, args.max_batch_size, wait_s), name="openai", route_prefix="/v1")
        serve.run(KServePeer.bind(model_repo, args.max_batch_size, wait_s), name="kserve", route_prefix="/v2")
        print(f"READY {args.port}", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
