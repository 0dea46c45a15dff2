"""Per-stage durations carried back in every response."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from infermesh.v1 import common_pb2

_STAGE_BY_NAME = {
    name.removeprefix("STAGE_").lower(): value
    for name, value in common_pb2.Stage.items()
    if value != common_pb2.STAGE_UNSPECIFIED
}
STAGE_NAMES = frozenset(_STAGE_BY_NAME)
_NAME_BY_STAGE = {value: name for name, value in _STAGE_BY_NAME.items()}


@dataclass(frozen=True)
class StageTime:
    stage: str  # "queue_wait", "compute", ... (common.proto Stage without the prefix)
    duration_us: int
    service: str

    def __post_init__(self) -> None:
        if self.stage not in _STAGE_BY_NAME:
            raise ValueError(f"unknown stage {self.stage!r}; known: {sorted(STAGE_NAMES)}")


def to_proto(stages: Iterable[StageTime], total_us: int = 0) -> common_pb2.Timings:
    return common_pb2.Timings(
        stages=[
            common_pb2.StageTiming(stage=_STAGE_BY_NAME[s.stage], duration_us=int(s.duration_us), service=s.service)
            for s in stages
        ],
        total_us=int(total_us),
    )


def from_proto(timings: common_pb2.Timings) -> list[StageTime]:
    """The stages this build knows (unspecified ones, and a newer peer's, are left out). A dict lookup
    per stage: the worker decodes its own timings for metrics after every generate step."""
    names = _NAME_BY_STAGE
    return [StageTime(names[s.stage], s.duration_us, s.service) for s in timings.stages if s.stage in names]


def seconds_to_us(seconds: float) -> int:
    return max(0, round(seconds * 1_000_000))
