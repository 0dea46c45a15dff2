"""A server that does no work, for measuring the load harness itself: its CPU and its schedule lag.

    .venv/bin/python -m bench.loadtest.stub_server --grpc-port P --http-port Q [--token-interval-ms 10]

infermesh.v1.Inference on gRPC (Classify answers at once; Generate streams `max_tokens` one-token
chunks, one every --token-interval-ms, then the last chunk with usage and timings; ListModels lists
`digits` and `tinylm`) and the OpenAI API on HTTP (/v1/models; /v1/completions and
/v1/chat/completions, streamed or whole, with the same pacing and a usage chunk). Plaintext,
127.0.0.1, on uvloop; prints `READY` once both listen and stops on SIGTERM. Its own CPU is the
server's, not the harness's: bench_harness_cpu measures the harness process alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal

import grpc
import uvloop
from aiohttp import web

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

_TIMINGS = common_pb2.Timings(total_us=300, stages=[
    common_pb2.StageTiming(stage=common_pb2.STAGE_ADMISSION, duration_us=20, service="gateway"),
    common_pb2.StageTiming(stage=common_pb2.STAGE_QUEUE_WAIT, duration_us=80, service="scheduler"),
    common_pb2.StageTiming(stage=common_pb2.STAGE_COMPUTE, duration_us=200, service="worker"),
])


class StubInference(gateway_pb2_grpc.InferenceServicer):
    def __init__(self, token_interval_s: float) -> None:
        self._token_interval_s = token_interval_s

    async def Classify(self, request, context):
        return gateway_pb2.ClassifyResponse(
            request_id=request.request_id, model=common_pb2.ModelRef(name=request.model.name, version="1"),
            labels=[common_pb2.Label(label="3", index=3, score=0.9)], timings=_TIMINGS)

    async def Generate(self, request, context):
        num_tokens = request.sampling.max_tokens or 16
        for i in range(num_tokens):
            await asyncio.sleep(self._token_interval_s)
            yield gateway_pb2.GenerateResponse(request_id=request.request_id, token_ids=[97], text="a", index=i)
        yield gateway_pb2.GenerateResponse(
            request_id=request.request_id, index=num_tokens, finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=common_pb2.Usage(prompt_tokens=len(request.prompt), completion_tokens=num_tokens),
            ttft_us=round(self._token_interval_s * 1e6), timings=_TIMINGS)

    async def ListModels(self, request, context):
        return gateway_pb2.ListModelsResponse(models=[
            gateway_pb2.ModelInfo(model=common_pb2.ModelRef(name="digits", version="1"),
                                  kind=common_pb2.MODEL_KIND_CLASSIFIER, ready=True),
            gateway_pb2.ModelInfo(model=common_pb2.ModelRef(name="tinylm", version="1"),
                                  kind=common_pb2.MODEL_KIND_GENERATOR, ready=True),
        ])


class StubOpenAI:
    def __init__(self, token_interval_s: float) -> None:
        self._token_interval_s = token_interval_s

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([web.post("/v1/completions", self.complete), web.post("/v1/chat/completions", self.complete),
                        web.get("/v1/models", self.models)])
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tinylm", "object": "model"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = request.path.endswith("/chat/completions")
        num_tokens = int(body.get("max_tokens") or 16)
        usage = {"prompt_tokens": 8, "completion_tokens": num_tokens, "total_tokens": 8 + num_tokens}
        if not body.get("stream"):
            await asyncio.sleep(self._token_interval_s * num_tokens)
            text = "a" * num_tokens
            choice = {"index": 0, "finish_reason": "length",
                      **({"message": {"role": "assistant", "content": text}} if chat else {"text": text})}
            return web.json_response({"choices": [choice], "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(num_tokens):
            await asyncio.sleep(self._token_interval_s)
            choice = {"index": 0, "finish_reason": "length" if i == num_tokens - 1 else None,
                      **({"delta": {"content": "a"}} if chat else {"text": "a"})}
            await response.write(_event({"choices": [choice]}))
        await response.write(_event({"choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _event(value: dict) -> bytes:
    return b"data: " + json.dumps(value, separators=(",", ":")).encode() + b"\n\n"


async def serve(grpc_port: int, http_port: int, token_interval_s: float) -> None:
    server = grpc.aio.server()
    gateway_pb2_grpc.add_InferenceServicer_to_server(StubInference(token_interval_s), server)
    server.add_insecure_port(f"127.0.0.1:{grpc_port}")
    await server.start()
    runner = web.AppRunner(StubOpenAI(token_interval_s).app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", http_port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("READY", flush=True)
    await stop.wait()
    await runner.cleanup()
    await server.stop(grace=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--token-interval-ms", type=float, default=10.0)
    args = parser.parse_args()
    uvloop.run(serve(args.grpc_port, args.http_port, args.token_interval_ms / 1000))


if __name__ == "__main__":
    main()
