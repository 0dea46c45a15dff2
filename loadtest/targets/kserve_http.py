"""The Target over KServe v2 REST (aiohttp): POST /v2/models/{name}[/versions/{v}]/infer for classify
and tensor classes, with the binary tensor extension (as tritonclient's HTTP client sends it), so a request's
bytes match what a real client sends rather than a JSON list of pixels.

KServe v2 REST has no streaming inference, so generate classes go to kserve+grpc (ModelStreamInfer);
this kind refuses them when the scenario is opened. Replies carry no stage timings unless the
server adds a Server-Timing header.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterable
from urllib.parse import quote

import aiohttp

from loadtest.payloads import ImagePayload, TensorPayload
from loadtest.records import OK, Outcome
from loadtest.runner import Clock, MonotonicClock
from loadtest.scenario import ClassSpec, RequestKind
from loadtest.targets import kserve_tensors
from loadtest.targets.address import TargetAddress
from loadtest.targets.base import TargetError, TraceIds, http_status_name, request_start_value
from loadtest.targets.openai_http import TIMEOUT_HEADER, ssl_context
from loadtest.targets.server_timing import SERVER_TIMING, parse_server_timing
from loadtest.workload import PlannedRequest

HEADER_LENGTH = "Inference-Header-Content-Length"


def check_classes(classes: Iterable[ClassSpec], url: str) -> None:
    for c in classes:
        if c.kind is RequestKind.GENERATE:
            raise ValueError(f"class {c.name!r} is {c.kind.value}: KServe v2 REST ({url}) has no streaming "
                             f"inference; send generate classes to kserve+grpc:// (ModelStreamInfer)")


class KServeHttpTarget:
    def __init__(self, address: TargetAddress, clock: Clock | None = None, run_id: str = "lt",
                 ca_file: str = "") -> None:
        self._base_url = address.base_url
        self._clock = clock or MonotonicClock()
        self._run_id = run_id
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ssl=ssl_context(address, ca_file)))
        self._bodies: dict[int, tuple[bytes, int]] = {}
        self._traces = TraceIds()

    async def close(self) -> None:
        await self._session.close()

    async def ready_models(self, models: Iterable[str], api_key: str, timeout_s: float) -> set[str]:
        ready = set()
        for name in models:
            try:
                async with self._session.get(f"{self._base_url}/v2/models/{quote(name, safe='')}/ready",
                                             headers=_auth(api_key),
                                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as reply:
                    if reply.status == 200:
                        ready.add(name)
                    elif reply.status not in (404, 503):
                        raise TargetError(f"GET /v2/models/{name}/ready: HTTP {reply.status}: "
                                          f"{(await reply.text())[:200]}")
            except (aiohttp.ClientError, TimeoutError) as err:
                raise TargetError(f"GET /v2/models/{name}/ready failed: {type(err).__name__}: {err}") from None
        return ready

    async def send(self, request: PlannedRequest, timeout_s: float | None) -> Outcome:
        trace = self._traces.for_request(request.seq)
        outcome = await self._send(request, trace.traceparent, timeout_s)
        return dataclasses.replace(outcome, trace_id=trace.trace_id)

    async def _send(self, request: PlannedRequest, traceparent: str, timeout_s: float | None) -> Outcome:
        c = request.request_class
        body, header_length = self._body(request)
        path = f"/v2/models/{quote(c.model, safe='')}" + (f"/versions/{quote(c.version, safe='')}" if c.version else "")
        headers = {**_auth(request.tenant.api_key), "x-request-start": request_start_value(),
                   "Content-Type": "application/octet-stream", HEADER_LENGTH: str(header_length),
                   "traceparent": traceparent}
        if timeout_s is not None:
            headers[TIMEOUT_HEADER] = str(round(timeout_s * 1000))
        sent_s = self._clock.now_s()
        try:
            async with asyncio.timeout(timeout_s):
                async with self._session.post(f"{self._base_url}{path}/infer", data=body, headers=headers) as reply:
                    raw = await reply.read()
                    done_s = self._clock.now_s()
                    if reply.status != 200:
                        return Outcome(http_status_name(reply.status), sent_s, done_s, _message(raw))
                    timings = parse_server_timing(reply.headers.get(SERVER_TIMING))
                    return Outcome(OK, sent_s, done_s, stages=timings.stages, server_total_us=timings.total_us)
        except TimeoutError:
            return Outcome("DEADLINE_EXCEEDED", sent_s, self._clock.now_s(), f"no reply within {timeout_s} s")
        except aiohttp.ClientError as err:
            return Outcome("UNAVAILABLE", sent_s, self._clock.now_s(), f"{type(err).__name__}: {err}")

    def _body(self, request: PlannedRequest) -> tuple[bytes, int]:
        """The JSON header and the binary tensors, built once per payload."""
        cached = self._bodies.get(request.payload_key)
        if cached is None:
            assert isinstance(request.payload, ImagePayload | TensorPayload)  # check_classes refused generate
            cached = infer_body(request.payload)
            self._bodies[request.payload_key] = cached
        return cached


def infer_body(payload: ImagePayload | TensorPayload) -> tuple[bytes, int]:
    """The body (JSON header, then every input's raw bytes in input order) and the header's length.
    A tensor class asks for its outputs as binary too (tritonclient's default), so the reply is not a JSON
    list of every score."""
    tensors = kserve_tensors.request_tensors(payload)
    document: dict = {"inputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape),
                                  "parameters": {"binary_data_size": len(t.raw)}} for t in tensors]}
    if isinstance(payload, TensorPayload):
        document["parameters"] = {"binary_data_output": True}
    header = json.dumps(document).encode()
    return header + b"".join(t.raw for t in tensors), len(header)


def _auth(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}


def _message(raw: bytes) -> str:
    try:
        error = json.loads(raw).get("error")
        if error:
            return str(error)
    except (ValueError, AttributeError):
        pass
    return raw[:200].decode("utf-8", "replace")
