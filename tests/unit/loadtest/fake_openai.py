"""A tiny OpenAI-compatible HTTP server (aiohttp) for the load test's unit tests.

/v1/completions and /v1/chat/completions answer with `max_tokens` chunks of "a" after `token_s`
each (streamed as server-sent events, or whole), usage when asked (and `send_usage`), a
Server-Timing header when `server_timing`. The `stall_on_call`-th call (1-based) holds the server
for `stall_s`, and every call arriving meanwhile waits for it, like a GC pause or a stuck batch.
"""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web


class FakeOpenAI:
    def __init__(self, token_s: float = 0.001, stall_on_call: int = 0, stall_s: float = 0.0, send_usage: bool = True,
                 server_timing: bool = False, rejected_keys: frozenset[str] = frozenset(), models=("tinylm",),
                 chunk_text: str = "a") -> None:
        self.token_s = token_s
        self.stall_on_call = stall_on_call
        self.stall_s = stall_s
        self.send_usage = send_usage
        self.server_timing = server_timing
        self.rejected_keys = rejected_keys
        self.models = models
        self.chunk_text = chunk_text
        self.num_calls = 0
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self._stall_until_s = 0.0
        self.in_flight = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([web.post("/v1/completions", self.complete), web.post("/v1/chat/completions", self.complete),
                        web.get("/v1/models", self.list_models), web.get("/metrics", self.metrics)])
        return app

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text: a gauge of requests in flight and a counter of calls, as vLLM names them."""
        text = ("# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{model_name="tinylm"}} {self.in_flight}\n'
                "# TYPE vllm:request_success counter\n"
                f'vllm:request_success_total{{model_name="tinylm"}} {self.num_calls}\n')
        return web.Response(text=text, content_type="text/plain")

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        self.in_flight += 1
        try:
            return await self._complete(request)
        finally:
            self.in_flight -= 1

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        start_s = time.perf_counter()
        body = await request.json()
        self.num_calls += 1
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        key = request.headers.get("Authorization", "").removeprefix("Bearer ")
        if key in self.rejected_keys:
            return web.json_response({"error": {"message": f"rate limited: {key}", "type": "rate_limit_error"}},
                                     status=429)
        if self.num_calls == self.stall_on_call:
            self._stall_until_s = start_s + self.stall_s
        if self._stall_until_s > start_s:
            await asyncio.sleep(self._stall_until_s - start_s)
        chat = request.path.endswith("/chat/completions")
        num_tokens = body.get("max_tokens", 4)
        usage = {"prompt_tokens": 3, "completion_tokens": num_tokens, "total_tokens": 3 + num_tokens}
        if not body.get("stream"):
            await asyncio.sleep(self.token_s * num_tokens)
            text = self.chunk_text * num_tokens
            choice = {"index": 0, "finish_reason": "length",
                      **({"message": {"role": "assistant", "content": text}} if chat else {"text": text})}
            reply = {"choices": [choice], **({"usage": usage} if self.send_usage else {})}
            return web.json_response(reply, headers=self._timing_header(start_s))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **self._timing_header(start_s)})
        await response.prepare(request)
        for i in range(num_tokens):
            await asyncio.sleep(self.token_s)
            reason = "length" if i == num_tokens - 1 else None
            choice = {"index": 0, "finish_reason": reason,
                      **({"delta": {"content": self.chunk_text}} if chat else {"text": self.chunk_text})}
            await response.write(_event({"choices": [choice]}))
        if self.send_usage and (body.get("stream_options") or {}).get("include_usage"):
            await response.write(_event({"choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _timing_header(self, start_s: float) -> dict[str, str]:
        if not self.server_timing:
            return {}
        return {"Server-Timing": f"queue;dur=0.5, compute;dur=1.25, total;dur={(time.perf_counter() - start_s) * 1e3:.3f}"}


def _event(value: dict) -> bytes:
    return b"data: " + json.dumps(value).encode() + b"\n\n"


async def start_fake_openai(server: FakeOpenAI) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(server.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"openai+http://127.0.0.1:{port}/v1"
