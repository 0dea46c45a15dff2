"""The manifest's `generator.sampling_defaults`: a model's recommended sampling, which requests that
leave a field to the model get (GenerateRequest.model_default_fields; the OpenAI front lists the
fields a body leaves out). `infermesh models import` records what the checkpoint's
generation_config.json says, as vLLM reads it by default (`--generation-config auto`): temperature,
top_p, top_k, min_p and repetition_penalty where present; do_sample is not read (nor by vLLM)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from infermesh.v1 import common_pb2
from services.common.sampling_bounds import MAX_PENALTY, MAX_TOP_K
from services.worker.repository.json_fields import JsonFields


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and (problem := _problem(f.name, value)):
                raise ValueError(f"{f.name} {problem}, got {value!r}")

    @property
    def empty(self) -> bool:
        return all(getattr(self, f.name) is None for f in fields(self))

    @classmethod
    def from_generation_config(cls, data: Mapping[str, Any], file: str) -> SamplingDefaults:
        """The recommended values in a generation_config.json dict; ValueError naming the file and field
        of one the mesh cannot sample with."""
        values = {f.name: data[f.name] for f in fields(cls) if data.get(f.name) is not None}
        for name, value in values.items():
            if problem := _problem(name, value):
                raise ValueError(f"{file}: {name} {problem}, got {value!r} (import with --generation-config none "
                                 "to leave the model without recommended sampling)")
        return cls(**values)

    @classmethod
    def from_json(cls, s: JsonFields) -> SamplingDefaults:
        s.allow_only(*(f.name for f in fields(cls)))
        values = {}
        for name, value in s.data.items():
            if problem := _problem(name, value):
                raise s.fail(name, f"{problem}, got {value!r}")
            values[name] = value
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def to_proto(self) -> common_pb2.SamplingDefaults:
        return common_pb2.SamplingDefaults(**self.to_json())


def _problem(name: str, value: Any) -> str:
    """Why `value` cannot be the model's `name`; "" when it can."""
    if name == "top_k":
        ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOP_K
        return "" if ok else f"must be an integer in [0, {MAX_TOP_K}] (0: off)"
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        return "must be a finite number"
    bounds = {"temperature": (0.0, math.inf, "must be >= 0"), "top_p": (0.0, 1.0, "must be in (0, 1]"),
              "min_p": (0.0, 1.0, "must be in [0, 1]"),
              "repetition_penalty": (0.0, MAX_PENALTY, f"must be in (0, {MAX_PENALTY:g}]")}
    low, high, says = bounds[name]
    if name in ("top_p", "repetition_penalty"):
        return "" if low < value <= high else says
    return "" if low <= value <= high else says
