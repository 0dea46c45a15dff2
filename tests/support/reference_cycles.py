"""Whether the server's side of a refused gRPC call leaves garbage only the cycle collector frees."""

from __future__ import annotations

import gc
from collections.abc import Awaitable, Callable

import grpc

from services.common.errors import InfermeshError


async def assert_refusals_leave_no_cycle(refuse: Callable[[], Awaitable[object]], times: int = 20) -> None:
    """Calls `refuse` (one refused call) once to get first-call set-up out of the way, then `times` times
    with the collector saving what it frees: no frame of services/ code and no server-side error may
    be among it (context.abort()'s AbortError kept each call's frames in a cycle). The client's own
    errors keep their tracebacks, so only the server's side is checked."""
    await refuse()
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(times):
            await refuse()
        gc.collect()
        garbage = list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    servicer_frames = [o for o in garbage if type(o).__name__ == "frame" and "services/" in o.f_code.co_filename]
    server_errors = [type(o).__name__ for o in garbage if isinstance(o, InfermeshError | grpc.aio.AbortError)]
    assert servicer_frames == [] and server_errors == []
