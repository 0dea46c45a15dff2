"""Reading one JSON object of a manifest strictly: every value typed, unknown keys refused, errors named.

Every message starts with the manifest's file and names the field by its dotted path
(`classifier.inputs.std`, `generator.golden[2].expected_ids`), so a person can find it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import numpy as np

from services.worker.repository.errors import InvalidManifest


class JsonFields:
    """A JSON object being read, with its path for error messages; rejects unknown keys."""

    def __init__(self, data: Any, source: str, path: str) -> None:
        if not isinstance(data, dict):
            raise InvalidManifest(f"{source}: {path or 'manifest'} must be an object, got {type(data).__name__}")
        self.data, self.source, self.path = data, source, path

    def fail(self, key: str, problem: str) -> InvalidManifest:
        return InvalidManifest(f"{self.source}: field '{self._at(key)}' {problem}")

    def _at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def allow_only(self, *keys: str) -> None:
        unknown = sorted(set(self.data) - set(keys))
        if unknown:
            raise InvalidManifest(f"{self.source}: unknown field(s) {unknown} in {self.path or 'manifest'}")

    def raw(self, key: str) -> Any:
        if key not in self.data:
            raise InvalidManifest(f"{self.source}: missing field '{self._at(key)}'")
        return self.data[key]

    def obj(self, key: str) -> JsonFields:
        return JsonFields(self.raw(key), self.source, self._at(key))

    def text(self, key: str, pattern: re.Pattern[str] | None = None) -> str:
        value = self.raw(key)
        if not isinstance(value, str) or not value:
            raise self.fail(key, f"must be a non-empty string, got {value!r}")
        if pattern is not None and not pattern.match(value):
            raise self.fail(key, f"must match {pattern.pattern}, got {value!r}")
        return value

    def integer(self, key: str, minimum: int = 0) -> int:
        value = self.raw(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self.fail(key, f"must be an integer >= {minimum}, got {value!r}")
        return value

    def number(self, key: str) -> float:
        value = self.raw(key)
        if not isinstance(value, int | float) or isinstance(value, bool) or not np.isfinite(value):
            raise self.fail(key, f"must be a finite number, got {value!r}")
        return float(value)

    def array(self, key: str, min_len: int = 0) -> list[Any]:
        value = self.raw(key)
        if not isinstance(value, list) or len(value) < min_len:
            raise self.fail(key, f"must be a list of at least {min_len} entries, got {value!r:.80}")
        return value

    def ints(self, key: str, lo: int, hi: int, min_len: int = 1) -> tuple[int, ...]:
        values = self.array(key, min_len)
        if not all(isinstance(v, int) and not isinstance(v, bool) and lo <= v < hi for v in values):
            raise self.fail(key, f"must hold integers in [{lo}, {hi})")
        return tuple(values)

    def numbers(self, key: str, length: int) -> tuple[float, ...]:
        values = self.array(key)
        if len(values) != length or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            raise self.fail(key, f"must be {length} numbers, got {values!r}")
        return tuple(float(v) for v in values)

    def items(self, key: str, min_len: int) -> list[JsonFields]:
        return [JsonFields(v, self.source, f"{self._at(key)}[{i}]") for i, v in enumerate(self.array(key, min_len))]


def one_of(names: Iterable[str]) -> str:
    """`'a' or 'b'` for a schema table's keys, as the refusal of an unknown kind lists them."""
    return " or ".join(repr(name) for name in names)
