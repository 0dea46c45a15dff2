"""`Server-Timing` (W3C) on the gateway's HTTP replies: the stages the gRPC replies carry in `timings`.

    Server-Timing: gateway.admission;dur=0.021, scheduler.queue_wait;dur=1.502, ..., total;dur=3.250

Each stage is `<service>.<stage>` with its duration in milliseconds, then `total`, the gateway's
whole time. The OpenAI front writes the same value as `x-infermesh-timings` on whole replies;
the KServe REST front on every inference reply. A streamed reply's headers leave before any stage
is known, so a stream carries its stages in its last event's `infermesh.timings` instead.
"""

from __future__ import annotations

from aiohttp import web

from infermesh.v1 import common_pb2

SERVER_TIMING = "Server-Timing"
TIMINGS_HEADER = "x-infermesh-timings"  # our name for the same value, older than Server-Timing here

_STAGE_NAMES = {value: name.removeprefix("STAGE_").lower() for name, value in common_pb2.Stage.items()}


def header_value(timings: common_pb2.Timings) -> str:
    parts = [f"{s.service}.{_STAGE_NAMES.get(s.stage, s.stage)};dur={s.duration_us / 1000:.3f}"
             for s in timings.stages]
    parts.append(f"total;dur={timings.total_us / 1000:.3f}")
    return ", ".join(parts)


async def copy_to_server_timing(request: web.Request, response: web.StreamResponse) -> None:
    """An `on_response_prepare` hook: a reply that carries x-infermesh-timings carries Server-Timing too."""
    value = response.headers.get(TIMINGS_HEADER)
    if value is not None and SERVER_TIMING not in response.headers:
        response.headers[SERVER_TIMING] = value
