"""Server-Timing on the gateway's HTTP replies: the gRPC replies' stage timings, in W3C syntax."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from infermesh.v1 import common_pb2
from services.gateway.fronts.server_timing import (
    SERVER_TIMING,
    TIMINGS_HEADER,
    copy_to_server_timing,
    header_value,
)
from tools.testbed.processes import free_port


def test_header_value_names_each_stage_by_service_in_milliseconds_then_the_total():
    timings = common_pb2.Timings(total_us=3250, stages=[
        common_pb2.StageTiming(service="gateway", stage=common_pb2.STAGE_ADMISSION, duration_us=21),
        common_pb2.StageTiming(service="scheduler", stage=common_pb2.STAGE_QUEUE_WAIT, duration_us=1502),
    ])
    assert header_value(timings) == "gateway.admission;dur=0.021, scheduler.queue_wait;dur=1.502, total;dur=3.250"


async def test_a_reply_with_our_timings_header_carries_server_timing_and_others_do_not():
    async def timed(request: web.Request) -> web.Response:
        return web.json_response({}, headers={TIMINGS_HEADER: "gateway.admission;dur=0.021, total;dur=1.000"})

    async def plain(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.on_response_prepare.append(copy_to_server_timing)
    app.add_routes([web.get("/timed", timed), web.get("/plain", plain)])
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/timed") as reply:
                assert reply.headers[SERVER_TIMING] == "gateway.admission;dur=0.021, total;dur=1.000"
            async with session.get(f"http://127.0.0.1:{port}/plain") as reply:
                assert SERVER_TIMING not in reply.headers
    finally:
        await runner.cleanup()
