"""The Target over OpenAI's HTTP API (aiohttp): /v1/completions and /v1/chat/completions.

Streamed requests ask for `stream_options.include_usage`; the time of every event that carries
content is a chunk time (TTFT is the first of them). The output token count is the final usage
chunk's `completion_tokens` when the server sends one, else the scenario's tokenizer counts the
text. Stages come from a Server-Timing (or our gateway's x-infermesh-timings) header and from
infermesh's `timings` extension on the body or the last event; a server that sends neither is
reported without stage columns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import ssl
from collections.abc import Iterable

import aiohttp

from loadtest.payloads import TextPayload
from loadtest.records import OK, STREAM_TRUNCATED, Outcome
from loadtest.runner import Clock, MonotonicClock
from loadtest.scenario import ClassSpec, RequestKind, TextApi
from loadtest.targets.address import TargetAddress
from loadtest.targets.base import TargetError, TraceIds, http_status_name, request_start_value
from loadtest.targets.server_timing import (
    INFERMESH_TIMINGS,
    SERVER_TIMING,
    ServerTimings,
    parse_server_timing,
    parse_timings_extension,
)
from loadtest.targets.sse import DONE, SseDecoder
from loadtest.targets.token_count import TokenCounter
from loadtest.workload import PlannedRequest

STREAM_ERROR = "STREAM_ERROR"  # an error event after the stream had started
BAD_REPLY = "BAD_REPLY"  # a 200 whose body is not the JSON the API promises
TIMEOUT_HEADER = "x-infermesh-timeout-ms"
_PATHS = {TextApi.COMPLETIONS: "/completions", TextApi.CHAT: "/chat/completions"}


def check_classes(classes: Iterable[ClassSpec], url: str) -> None:
    for c in classes:
        if c.kind is not RequestKind.GENERATE:
            raise ValueError(f"class {c.name!r} is {c.kind.value}: an OpenAI target ({url}) serves generate "
                             f"classes only; send classify classes to a grpc:// or kserve+ target, tensor classes to a kserve+ target")


def ssl_context(address: TargetAddress, ca_file: str) -> ssl.SSLContext | bool:
    """https: the CA file's roots when given, else the system's; http: none."""
    if not address.https:
        return False
    try:
        return ssl.create_default_context(cafile=ca_file or None)
    except (OSError, ssl.SSLError) as err:
        raise ValueError(f"cannot use the CA file {ca_file}: {err}") from None


class OpenAITarget:
    def __init__(self, address: TargetAddress, counter: TokenCounter, clock: Clock | None = None,
                 run_id: str = "lt", ca_file: str = "") -> None:
        self._base_url = address.base_url
        self._counter = counter
        self._clock = clock or MonotonicClock()
        self._run_id = run_id
        self._traces = TraceIds()
        # limit=0: no cap on connections here; an open-loop run caps in flight with max_in_flight, where
        # the wait is charged to the request. auto_decompress stays on: servers may compress JSON.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ssl=ssl_context(address, ca_file)))

    async def close(self) -> None:
        await self._session.close()

    async def ready_models(self, models: Iterable[str], api_key: str, timeout_s: float) -> set[str]:
        try:
            async with self._session.get(f"{self._base_url}/models", headers=_auth(api_key),
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as reply:
                body = await reply.text()
                if reply.status != 200:
                    raise TargetError(f"GET /models: HTTP {reply.status}: {body[:200]}")
                listed = json.loads(body).get("data") or []
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, AttributeError) as err:
            raise TargetError(f"GET /models failed: {type(err).__name__}: {err}") from None
        served = {m.get("id") for m in listed if isinstance(m, dict)}
        return {m for m in models if m in served}

    async def send(self, request: PlannedRequest, timeout_s: float | None) -> Outcome:
        trace = self._traces.for_request(request.seq)
        outcome = await self._send(request, trace.traceparent, timeout_s)
        return dataclasses.replace(outcome, trace_id=trace.trace_id)

    async def _send(self, request: PlannedRequest, traceparent: str, timeout_s: float | None) -> Outcome:
        payload = request.payload
        assert isinstance(payload, TextPayload)  # check_classes let only generate classes through
        c = request.request_class
        body = _body(c, payload, request.seq)
        headers = {**_auth(request.tenant.api_key), "x-request-start": request_start_value(),
                   "x-request-id": f"{self._run_id}-{request.seq}", "traceparent": traceparent}
        if timeout_s is not None:
            headers[TIMEOUT_HEADER] = str(round(timeout_s * 1000))
        sent_s = self._clock.now_s()
        try:
            async with asyncio.timeout(timeout_s):
                async with self._session.post(self._base_url + _PATHS[c.api], json=body, headers=headers) as reply:
                    if reply.status != 200:
                        text = await reply.text()
                        return Outcome(http_status_name(reply.status), sent_s, self._clock.now_s(), _message(text))
                    if c.stream:
                        return await self._read_stream(reply, sent_s)
                    return await self._read_whole(reply, sent_s)
        except TimeoutError:
            return Outcome("DEADLINE_EXCEEDED", sent_s, self._clock.now_s(), f"no whole reply within {timeout_s} s")
        except aiohttp.ClientError as err:
            return Outcome("UNAVAILABLE", sent_s, self._clock.now_s(), f"{type(err).__name__}: {err}")

    async def _read_whole(self, reply: aiohttp.ClientResponse, sent_s: float) -> Outcome:
        raw = await reply.read()
        done_s = self._clock.now_s()
        try:
            doc = json.loads(raw)
            choice = doc["choices"][0]
            text = choice.get("text") if "text" in choice else (choice.get("message") or {}).get("content") or ""
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
            return Outcome(BAD_REPLY, sent_s, done_s, f"{type(err).__name__}: {raw[:200]!r}")
        timings = _header_timings(reply)
        if not timings.reported:
            timings = parse_timings_extension((doc.get("infermesh") or {}).get("timings"))
        num_tokens = _completion_tokens(doc.get("usage"))
        if num_tokens is None:
            num_tokens = self._counter.count(text or "")
        # The whole reply arrives at once: its first token is its last.
        return Outcome(OK, sent_s, done_s, stages=timings.stages, server_total_us=timings.total_us,
                       chunk_times_s=(done_s,) if num_tokens else (), num_output_tokens=num_tokens, text=text or "")

    async def _read_stream(self, reply: aiohttp.ClientResponse, sent_s: float) -> Outcome:
        """Reads the socket's chunks as they come (one await per read, not per line: the harness's CPU
        per streamed token), stamping every event in a chunk with the chunk's arrival time."""
        decoder = SseDecoder()
        stream = _StreamEvents(_header_timings(reply))
        async for chunk in reply.content.iter_any():
            now_s = self._clock.now_s()
            for data in decoder.feed(chunk):
                if data == DONE:
                    return stream.outcome(sent_s, self._clock.now_s(), self._counter)
                failed = stream.add(data, now_s)
                if failed is not None:
                    return stream.failure(*failed, sent_s, now_s, self._counter)
        tail = decoder.close()
        if tail is not None and tail != DONE:
            stream.add(tail, self._clock.now_s())
        return stream.outcome(sent_s, self._clock.now_s(), self._counter)


class _StreamEvents:
    """What a stream's events said so far: chunk times, texts, usage, finish, stage timings."""

    def __init__(self, header_timings: ServerTimings) -> None:
        self.chunk_times_s: list[float] = []
        self.texts: list[str] = []
        self.usage_tokens: int | None = None
        self.finished = False
        self.timings = header_timings

    def add(self, data: str, now_s: float) -> tuple[str, str] | None:
        """(status, message) when the event ends the stream as a failure."""
        try:
            event = json.loads(data)
        except ValueError:
            return BAD_REPLY, f"an event is not JSON: {data[:200]!r}"
        if not isinstance(event, dict):
            return None
        if "error" in event:
            return STREAM_ERROR, _message(json.dumps(event["error"]))
        text, reason = _choice_text(event)
        if text:
            self.chunk_times_s.append(now_s)
            self.texts.append(text)
        self.finished = self.finished or reason is not None
        if event.get("usage"):
            self.usage_tokens = _completion_tokens(event["usage"])
        if "infermesh" in event:
            extension = parse_timings_extension((event.get("infermesh") or {}).get("timings"))
            if extension.reported:
                self.timings = extension
        return None

    def num_tokens(self, counter: TokenCounter) -> int:
        return self.usage_tokens if self.usage_tokens is not None else counter.count("".join(self.texts))

    def failure(self, status: str, message: str, sent_s: float, done_s: float, counter: TokenCounter) -> Outcome:
        return Outcome(status, sent_s, done_s, message, chunk_times_s=tuple(self.chunk_times_s),
                       num_output_tokens=self.num_tokens(counter))

    def outcome(self, sent_s: float, done_s: float, counter: TokenCounter) -> Outcome:
        text = "".join(self.texts)
        num_tokens = self.num_tokens(counter)
        if not self.finished:
            return Outcome(STREAM_TRUNCATED, sent_s, done_s, "stream ended without a finish_reason",
                           chunk_times_s=tuple(self.chunk_times_s), num_output_tokens=num_tokens)
        return Outcome(OK, sent_s, done_s, stages=self.timings.stages, server_total_us=self.timings.total_us,
                       chunk_times_s=tuple(self.chunk_times_s), num_output_tokens=num_tokens, text=text)


def _body(c: ClassSpec, payload: TextPayload, seq: int) -> dict:
    body: dict = {"model": c.model, "max_tokens": payload.max_tokens, "temperature": c.temperature, "seed": seq,
                  "stream": c.stream}
    if c.ignore_eos:
        body["ignore_eos"] = True  # vLLM's and our extension: the output length stays what the scenario asks
    if c.api is TextApi.CHAT:
        body["messages"] = [{"role": "user", "content": payload.prompt}]
    else:
        body["prompt"] = payload.prompt
    if c.stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _choice_text(event: dict) -> tuple[str, str | None]:
    choices = event.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return "", None
    choice = choices[0]
    text = choice.get("text")
    if text is None:
        text = (choice.get("delta") or {}).get("content")
    return text or "", choice.get("finish_reason")


def _completion_tokens(usage: object) -> int | None:
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return usage["completion_tokens"]
    return None


def _header_timings(reply: aiohttp.ClientResponse) -> ServerTimings:
    timings = parse_server_timing(reply.headers.get(SERVER_TIMING))
    return timings if timings.reported else parse_server_timing(reply.headers.get(INFERMESH_TIMINGS))


def _auth(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}


def _message(text: str) -> str:
    """OpenAI's error shape's message when the body has it, else the start of the body."""
    try:
        error = json.loads(text).get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
    except (ValueError, AttributeError):
        pass
    return text[:200]
