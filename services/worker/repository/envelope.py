"""The manifest's `envelope` block: the capacity a worker declares at attach."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass, fields
from typing import Any

from services.worker.repository.json_fields import JsonFields


@dataclass(frozen=True)
class Envelope:
    """What the worker declares at attach; fields that do not apply to the kind are 0."""

    max_batch_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_kv_blocks: int
    block_size: int  # tokens per KV block
    memory_bytes: int  # weights + KV cache (+ activations estimate)

    @classmethod
    def from_json(cls, e: JsonFields, needed: Collection[str]) -> Envelope:
        """`needed`: the fields the model's kind uses, which must be >= 1 (the others may be 0)."""
        e.allow_only(*(f.name for f in fields(cls)))
        return cls(**{f.name: e.integer(f.name, 1 if f.name in needed else 0) for f in fields(cls)})

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
