"""The gateway's part of a response's stage timings, so the stages add up to what the client waited.

    ingress    the client's send (x-request-start) until the handler ran: the waiting a
               deadline already lost in transport and in the gateway's gRPC/event-loop queues
    admission  the admission checks
    network    the upstream call minus the scheduler's own total: transport both ways and the
               scheduler's queues before its handler ran (retries and backoff included)
    overhead   the rest of the gateway's handler time
    gateway    the gateway's total, handler start to reply (an aggregate, not a leaf)

`x-request-start` follows the convention proxies and APMs use (`t=<time>`); the unit is read
from the magnitude (seconds, milliseconds or microseconds since the epoch). A value that is
unreadable, in the future, or more than an hour old is ignored: it describes a clock, not a wait.
"""

from __future__ import annotations

from services.common.timings import StageTime, seconds_to_us

REQUEST_START_KEY = "x-request-start"
SERVICE = "gateway"
_MAX_INGRESS_S = 3600.0


def parse_request_start_s(value: str | bytes | None) -> float | None:
    """Unix seconds of `t=<number>` (or a bare number); None when absent or unreadable."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    text = value.strip().removeprefix("t=")
    try:
        number = float(text)
    except ValueError:
        return None
    if number > 1e14:
        return number / 1e6
    if number > 1e11:
        return number / 1e3
    return number if number > 0 else None


def ingress_s(request_start_s: float | None, handler_start_unix_s: float) -> float | None:
    if request_start_s is None:
        return None
    waited_s = handler_start_unix_s - request_start_s
    return waited_s if 0 <= waited_s <= _MAX_INGRESS_S else None


def gateway_stages(*, ingress_s: float | None, admission_s: float, upstream_s: float | None,
                   upstream_total_us: int, total_s: float) -> list[StageTime]:
    """The gateway's leaf stages plus its total; `upstream_s` None when no upstream call was made."""
    stages = []
    if ingress_s is not None:
        stages.append(StageTime("ingress", seconds_to_us(ingress_s), SERVICE))
    stages.append(StageTime("admission", seconds_to_us(admission_s), SERVICE))
    own_s = total_s - admission_s
    if upstream_s is not None:
        stages.append(StageTime("network", max(0, seconds_to_us(upstream_s) - upstream_total_us), SERVICE))
        own_s -= upstream_s
    stages.append(StageTime("overhead", seconds_to_us(max(0.0, own_s)), SERVICE))
    stages.append(StageTime("gateway", seconds_to_us(total_s), SERVICE))
    return stages
