"""Request traces to replay: JSONL files of arrival times, input and output lengths. Pure parsing.

Two layouts, told apart per line by their keys:
  Mooncake / AIPerf (`mooncake_trace`):
      {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48]}
      timestamp in milliseconds; each hash id names one `block_tokens`-token block of the prompt,
      so requests listing the same leading ids share that prefix; optional "session_id".
  infermesh's own:
      {"t_s": 1.25, "prompt_len": 512, "output_len": 64, "session": "u7", "prefix_group": "sys-a",
       "prefix_len": 256}
      t_s in seconds; requests of one prefix_group share their first prefix_len tokens.
Times become seconds since the trace's first request, in order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TraceEntry:
    t_s: float  # seconds since the trace's first request, before any speed-up
    input_len: int  # prompt tokens
    output_len: int  # max_tokens
    session: str = ""
    prefix_group: str = ""  # ours: requests of a group share prefix_len tokens
    prefix_len: int = 0
    hash_ids: tuple[int, ...] = ()  # Mooncake: one per block of the prompt


def read_trace(path: Path) -> tuple[TraceEntry, ...]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise ValueError(f"trace: cannot read {path}: {err.strerror or err}") from None
    entries = [parse_entry(line, f"{path}:{i}") for i, line in enumerate(lines, 1) if line.strip()]
    if not entries:
        raise ValueError(f"trace: {path} holds no requests")
    entries.sort(key=lambda e: e.t_s)
    first_s = entries[0].t_s
    return tuple(_shifted(e, first_s) for e in entries)


def parse_entry(line: str, where: str) -> TraceEntry:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not JSON ({err.msg})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    if "timestamp" in raw:
        hash_ids = raw.get("hash_ids", [])
        if not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hash_ids):
            raise ValueError(f"{where}: hash_ids must be a list of integers")
        return TraceEntry(_number(raw, "timestamp", where) / 1000, _count(raw, "input_length", where),
                          _count(raw, "output_length", where), str(raw.get("session_id", "")),
                          hash_ids=tuple(hash_ids))
    if "t_s" in raw:
        prefix_len = int(_number(raw, "prefix_len", where)) if "prefix_len" in raw else 0
        entry = TraceEntry(_number(raw, "t_s", where), _count(raw, "prompt_len", where),
                           _count(raw, "output_len", where), str(raw.get("session", "")),
                           str(raw.get("prefix_group", "")), prefix_len)
        if not 0 <= entry.prefix_len <= entry.input_len:
            raise ValueError(f"{where}: prefix_len must be in 0..prompt_len, got {entry.prefix_len}")
        return entry
    raise ValueError(f"{where}: neither layout: expected 'timestamp' (Mooncake/AIPerf) or 't_s' (infermesh)")


def _number(raw: dict, key: str, where: str) -> float:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"{where}: {key} must be a number >= 0, got {value!r}")
    return float(value)


def _count(raw: dict, key: str, where: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {key} must be an integer >= 1, got {value!r}")
    return value


def _shifted(entry: TraceEntry, first_s: float) -> TraceEntry:
    return TraceEntry(entry.t_s - first_s, entry.input_len, entry.output_len, entry.session, entry.prefix_group,
                      entry.prefix_len, entry.hash_ids)
