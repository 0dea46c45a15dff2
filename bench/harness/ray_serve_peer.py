"""A server that is not ours, for the load harness to measure beside the mesh: Ray Serve serving our
repository's models, batching whole requests with `@serve.batch` (the peer issues 33, 34 and 37 name).

    .venv-rayserve/bin/python -m bench.harness.ray_serve_peer --port PORT [--grpc-port PORT]
        [--model-repo model_repo] [--max-batch-size 32] [--batch-wait-ms 5] [--temp-dir DIR]

Run with the Ray venv's python (tests/support/side_venv.py builds it: `ray[serve]` from PyPI, the
project and its .venv's packages such as torch reached through a .pth file). One application, its
ingress (`Peer`) on 127.0.0.1:PORT (HTTP) and --grpc-port (gRPC):

    /v1/models, /v1/completions, /v1/chat/completions   OpenAI API for tinylm, streamed (SSE) or whole;
                                                         usage on the last event, no stage timings
    /v2/health/ready, /v2/models/digits[/versions/1]/ready, .../infer
                                                         KServe v2 REST for digits: IMAGE as BYTES [1, 1]
                                                         (PNG) or UINT8 [1, H, W, C], JSON or the binary
                                                         tensor extension; PROBABILITIES FP32 [1, classes]
    gRPC inference.GRPCInferenceService                 ModelInfer for digits (the same IMAGE in
                                                         raw_input_contents), ModelReady, ServerLive/Ready;
                                                         no ModelStreamInfer (Ray's proxy has no bidi streams)

Each model is a Ray Serve deployment (one replica) that loads it the way our worker does
(`load_model`, one torch thread) and runs it with the worker's own code: tinylm's steps are
StepExecutor.run, digits' batches BatchExecutor.execute; the ingress calls them through deployment
handles. What differs from the mesh is the batching: `@serve.batch` forms a batch of up to
--max-batch-size waiting requests (waiting at most --batch-wait-ms for it to fill) only when the
previous batch has ended; a generation batch prefills its members together, then decodes them
together until the longest is done (request-level batching, as issue 33's peer). Generation
ignores EOS, so outputs have exactly `max_tokens` tokens.

Everything stays on loopback: Ray runs in its one-machine mode (node address 127.0.0.1) and its
gRPC proxy's bind is moved from [::] to 127.0.0.1 (`bind_grpc_to_loopback`).

Prints `READY <port>` on stdout once the application answers; SIGTERM or SIGINT shuts Serve and the
local Ray cluster down.
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

# Before Ray is imported (it reads them then), and inherited by every process it starts:
# - nothing leaves the machine (Ray sends usage statistics home by default);
# - a one-process-tree cluster needs no token written to the home directory;
# - Ray's one-machine mode (its default on macOS): every Ray process takes 127.0.0.1 as the node's
#   address, so they reach each other on loopback, not on the address of the machine's interface.
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

from ray import serve  # noqa: E402
from ray.serve.handle import DeploymentHandle  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, Response, StreamingResponse  # noqa: E402

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
class TinyLM:
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

    async def stream(self, body: dict, chat: bool) -> AsyncIterator[bytes]:
        """The SSE events of a streamed completion (body: the request's JSON, already checked)."""
        generation, reply = self._generation(body, chat)
        async for event in self._events(generation, reply):
            yield event

    async def whole(self, body: dict, chat: bool) -> dict:
        generation, reply = self._generation(body, chat)
        texts = [text async for text in self._texts(generation, reply)]
        return reply.whole("".join(texts))

    def _generation(self, body: dict, chat: bool) -> tuple[Generation, _Reply]:
        seed = body.get("seed")
        generation = Generation(((self._bos,) if self._bos >= 0 else ()) + tuple(_prompt(body, chat).encode()),
                                int(body.get("max_tokens") or 16), float(body.get("temperature") or 0.0),
                                int(seed) if seed is not None else None)
        return generation, _Reply(chat, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                                  len(generation.prompt_ids))

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
class Digits:
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

    def num_classes(self) -> int:
        return self._num_classes

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)
    async def classify(self, images: list) -> list:
        from services.worker.work import BatchItem

        results, _ = self._executor.execute([BatchItem(i, image, top_k=self._num_classes)
                                             for i, image in enumerate(images)])
        return results


@serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
class Tensors:
    """A tensor model (`kind: tensor`, ONNX or TorchScript) as the worker runs it: requests whose rows
    have the same shape are stacked on dim 0 and run as one batch (issue 34's Ray Serve peer)."""

    def __init__(self, model_repo: str, name: str, max_batch_size: int, batch_wait_s: float) -> None:
        from services.worker.repository.loader import load_model
        from services.worker.thread_settings import set_library_threads

        set_library_threads(1)
        loaded = load_model(model_repo, name, VERSION, num_threads=1)
        self._model = loaded.tensor
        self.name = name
        self.run.set_max_batch_size(max_batch_size)
        self.run.set_batch_wait_timeout_s(batch_wait_s)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)
    async def run(self, requests: list[dict]) -> list[dict]:
        """Each request: {input name: array, batch on dim 0}; each answer: {output name: array}."""
        import numpy as np

        answers: list[dict] = [{} for _ in requests]
        by_shape: dict[tuple, list[int]] = {}
        for i, inputs in enumerate(requests):
            by_shape.setdefault(tuple((k, v.shape[1:], v.dtype.str) for k, v in sorted(inputs.items())), []).append(i)
        for members in by_shape.values():  # never stack rows of different shapes
            stacked = {k: np.concatenate([requests[i][k] for i in members]) for k in requests[members[0]]}
            outputs = self._model.run(stacked)
            start = 0
            for i in members:
                rows = next(iter(requests[i].values())).shape[0]
                answers[i] = {k: v[start:start + rows] for k, v in outputs.items()}
                start += rows
        return answers


@serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
class Peer:
    """The one ingress: the OpenAI API (/v1), KServe v2 REST (/v2) and KServe v2 gRPC (ModelInfer for
    digits, ModelReady, ServerLive, ServerReady); each model's deployment batches its own calls."""

    def __init__(self, tinylm: DeploymentHandle, digits: DeploymentHandle, tensors: DeploymentHandle | None = None,
                 tensor_model: str = "") -> None:
        self._tinylm = tinylm
        self._digits = digits
        self._tensors = tensors
        self._tensor_model = tensor_model  # "" when none is served
        self._num_classes: int | None = None

    async def __call__(self, request: Request) -> Response:
        path = request.url.path.rstrip("/")
        if path.startswith("/v2"):
            return await self._kserve_http(request, path)
        if request.method == "GET" and path.endswith("/models"):
            return JSONResponse({"object": "list", "data": [{"id": GENERATOR, "object": "model", "owned_by": "ray"}]})
        if request.method != "POST" or not path.endswith(("/completions", "/chat/completions")):
            return JSONResponse({"error": {"message": f"no route {request.method} {path}"}}, status_code=404)
        body = await request.json()
        chat = path.endswith("/chat/completions")
        if body.get("model") != GENERATOR or not _prompt(body, chat):
            return JSONResponse({"error": {"message": f"model must be {GENERATOR!r} with a prompt"}}, status_code=400)
        if body.get("stream"):
            return StreamingResponse(self._tinylm.options(stream=True).stream.remote(body, chat),
                                     media_type="text/event-stream")
        return JSONResponse(await self._tinylm.whole.remote(body, chat))

    async def _kserve_http(self, request: Request, path: str) -> Response:
        parts = path.strip("/").split("/")  # v2, models, NAME, [versions, V], VERB
        if parts in (["v2", "health", "ready"], ["v2", "health", "live"]):
            return JSONResponse({"ready": True})
        if len(parts) < 3 or parts[:2] != ["v2", "models"] or parts[2] != CLASSIFIER:
            return JSONResponse({"error": f"no model at {path}"}, status_code=404)
        verb = parts[-1] if len(parts) in (4, 6) else ""
        if verb == "ready":
            return JSONResponse({"name": CLASSIFIER, "ready": True})
        if verb != "infer" or request.method != "POST":
            return JSONResponse({"name": CLASSIFIER, "versions": [VERSION], "platform": "ray-serve"})
        try:
            image = _image_input(await request.body(), request.headers.get(HEADER_LENGTH))
            scores = await self._scores(image)
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        return JSONResponse({"model_name": CLASSIFIER, "model_version": VERSION, "outputs": [
            {"name": "PROBABILITIES", "datatype": "FP32", "shape": [1, len(scores)], "data": scores}]})

    # -- KServe v2 gRPC (Ray's proxy calls the method named as the RPC) ---------------------

    async def ServerLive(self, request):
        from inference import grpc_predict_v2_pb2 as kserve

        return kserve.ServerLiveResponse(live=True)

    async def ServerReady(self, request):
        from inference import grpc_predict_v2_pb2 as kserve

        return kserve.ServerReadyResponse(ready=True)

    async def ModelReady(self, request):
        from inference import grpc_predict_v2_pb2 as kserve

        return kserve.ModelReadyResponse(ready=request.name in (CLASSIFIER, self._tensor_model or CLASSIFIER))

    async def ModelInfer(self, request):
        """IMAGE as BYTES [1, 1] (PNG) or UINT8 [1, H, W, C] in raw_input_contents; PROBABILITIES FP32 back."""
        from inference import grpc_predict_v2_pb2 as kserve
        from services.worker.work import RawImage

        if self._tensor_model and request.model_name == self._tensor_model:
            return await self._infer_tensors(request)
        if request.model_name != CLASSIFIER or not request.inputs or not request.raw_input_contents:
            raise ValueError(f"ModelInfer serves {CLASSIFIER!r} with IMAGE in raw_input_contents")
        spec, raw = request.inputs[0], request.raw_input_contents[0]
        if spec.datatype == "BYTES":
            (size,) = struct.unpack_from("<I", raw)
            image: bytes | RawImage = raw[4:4 + size]
        else:
            image = RawImage(raw, spec.shape[1], spec.shape[2], spec.shape[3])
        scores = await self._scores(image)
        response = kserve.ModelInferResponse(model_name=CLASSIFIER, model_version=VERSION, id=request.id)
        response.outputs.add(name="PROBABILITIES", datatype="FP32", shape=[1, len(scores)])
        response.raw_output_contents.append(struct.pack(f"<{len(scores)}f", *scores))
        return response

    async def _infer_tensors(self, request):
        """Every input from raw_input_contents (its datatype and shape), every output back raw."""
        import numpy as np

        from inference import grpc_predict_v2_pb2 as kserve

        inputs = {spec.name: np.frombuffer(raw, _NUMPY_TYPES[spec.datatype]).reshape(tuple(spec.shape))
                  for spec, raw in zip(request.inputs, request.raw_input_contents, strict=True)}
        assert self._tensors is not None  # _tensor_model is set only with it
        outputs = await self._tensors.run.remote(inputs)
        response = kserve.ModelInferResponse(model_name=request.model_name, model_version=VERSION, id=request.id)
        datatypes = {v: k for k, v in _NUMPY_TYPES.items()}
        for name, value in outputs.items():
            response.outputs.add(name=name, datatype=datatypes[value.dtype.str], shape=list(value.shape))
            response.raw_output_contents.append(np.ascontiguousarray(value).tobytes())
        return response

    async def _scores(self, image) -> list[float]:
        if self._num_classes is None:
            self._num_classes = await self._digits.num_classes.remote()
        result = await self._digits.classify.remote(image)
        if result.error is not None:
            raise ValueError(result.error.message)
        scores = [0.0] * self._num_classes
        for label in result.labels:
            scores[label.index] = label.score
        return scores


# KServe datatypes of the tensor models' inputs and outputs, as numpy type strings (little-endian).
_NUMPY_TYPES = {"FP32": "<f4", "FP64": "<f8", "FP16": "<f2", "INT64": "<i8", "INT32": "<i4", "INT8": "|i1",
                "UINT8": "|u1", "BOOL": "|b1"}


def _prompt(body: dict, chat: bool) -> str:
    if chat:
        return "".join(str(m.get("content", "")) for m in body.get("messages", ()) if isinstance(m, dict))
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else ""


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


def bind_grpc_to_loopback() -> None:
    """Ray's gRPC proxy listens on [::] (every interface) and has no host option; this peer is for
    tests and benchmarks on 127.0.0.1 only. Run in every Ray worker process (runtime_env's
    worker_process_setup_hook), it makes the proxy's one bind call use 127.0.0.1 (a private Ray
    function: ray_serve_peer.py pins ray 2.60, and the tests check the address the proxy bound)."""
    from ray.serve._private import default_impl

    def add_grpc_address(server, address: str) -> None:
        server.add_insecure_port(address.replace("[::]", "127.0.0.1"))

    default_impl.add_grpc_address = add_grpc_address


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True, help="HTTP: the OpenAI API and KServe v2 REST")
    parser.add_argument("--grpc-port", type=int, default=0, help="KServe v2 gRPC (0: none)")
    parser.add_argument("--model-repo", default="model_repo")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--batch-wait-ms", type=float, default=5.0)
    parser.add_argument("--tensor-model", default="", help="also serve this tensor model over KServe gRPC")
    parser.add_argument("--tensor-model-repo", default="", help="its repository (default: --model-repo)")
    parser.add_argument("--temp-dir", default="", help="Ray's session files (default: Ray's own, /tmp/ray)")
    args = parser.parse_args()
    import ray

    model_repo = os.path.abspath(args.model_repo)
    # _node_ip_address: Ray's processes reach each other on 127.0.0.1, not on the address of the
    # machine's interface that Ray would detect (nothing of this peer's traffic leaves loopback).
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 1024 * 1024, logging_level="WARNING",
             log_to_driver=False, _temp_dir=args.temp_dir or None, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
                          "worker_process_setup_hook": "bench.harness.ray_serve_peer.bind_grpc_to_loopback"})
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        grpc_options = {"port": args.grpc_port, "grpc_servicer_functions": [
            "inference.grpc_predict_v2_pb2_grpc.add_GRPCInferenceServiceServicer_to_server"]} if args.grpc_port else None
        serve.start(http_options={"host": "127.0.0.1", "port": args.port}, grpc_options=grpc_options,
                    logging_config={"log_level": "WARNING"})
        wait_s = args.batch_wait_ms / 1000
        tensors = Tensors.bind(os.path.abspath(args.tensor_model_repo or model_repo), args.tensor_model,
                               args.max_batch_size, wait_s) if args.tensor_model else None
        serve.run(Peer.bind(TinyLM.bind(model_repo, args.max_batch_size, wait_s),
                            Digits.bind(model_repo, args.max_batch_size, wait_s), tensors, args.tensor_model),
                  name="peer", route_prefix="/")
        print(f"READY {args.port}", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
