"""Stage timings a server reports over HTTP, as StageSamples: pure parsing, no I/O.

Two sources, both optional:
  - a `Server-Timing` header (W3C), or our gateway's `x-infermesh-timings` in the same syntax:
    `<service>.<stage>;dur=<ms>, ..., total;dur=<ms>`. A metric without a dot is a stage of
    service "" (another server's own names); `total` is the server's whole time.
  - infermesh's JSON extension on a response body or a stream's last event:
    `{"total_us": N, "stages": [{"service", "stage", "duration_us"}]}`.
"""

from __future__ import annotations

from dataclasses import dataclass

from loadtest.records import StageSample

SERVER_TIMING = "Server-Timing"
INFERMESH_TIMINGS = "x-infermesh-timings"
_TOTAL = "total"


@dataclass(frozen=True)
class ServerTimings:
    stages: tuple[StageSample, ...] = ()
    total_us: int = 0  # 0: the server gave no total

    @property
    def reported(self) -> bool:
        return bool(self.stages) or self.total_us > 0


def parse_server_timing(value: str | None) -> ServerTimings:
    """Entries it cannot read (no `dur`, a bad number) are skipped: a peer's header is not ours to refuse."""
    if not value:
        return ServerTimings()
    stages: list[StageSample] = []
    total_us = 0
    for entry in value.split(","):
        name, *params = (p.strip() for p in entry.split(";"))
        duration_us = _duration_us(params)
        if not name or duration_us is None:
            continue
        if name == _TOTAL:
            total_us = duration_us
            continue
        service, dot, stage = name.rpartition(".")
        stages.append(StageSample(stage if dot else name, service, duration_us))
    return ServerTimings(tuple(stages), total_us)


def parse_timings_extension(value: object) -> ServerTimings:
    """infermesh's `timings` object; anything else (absent, another shape) reports nothing."""
    if not isinstance(value, dict):
        return ServerTimings()
    stages = []
    for item in value.get("stages") or ():
        if isinstance(item, dict) and isinstance(item.get("duration_us"), int):
            stages.append(StageSample(str(item.get("stage", "")), str(item.get("service", "")), item["duration_us"]))
    total = value.get("total_us")
    return ServerTimings(tuple(stages), total if isinstance(total, int) and total > 0 else 0)


def _duration_us(params: list[str]) -> int | None:
    for param in params:
        key, _, raw = param.partition("=")
        if key.strip().lower() == "dur":
            try:
                ms = float(raw.strip().strip('"'))
            except ValueError:
                return None
            return round(ms * 1000) if ms >= 0 else None
    return None
