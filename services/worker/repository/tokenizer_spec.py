"""The generator's `tokenizer` block, one schema per tokenizer kind.

A new tokenizer kind is one dataclass with its own `from_json`/`to_json` and the fields every
tokenizer has (kind, vocab_size, eos_token_id, bos_token_id), registered in TOKENIZERS under
its `tokenizer.kind` string.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from services.worker.repository.json_fields import JsonFields, one_of

BYTES = "bytes"


@dataclass(frozen=True)
class TokenizerSpec:
    kind: str  # "bytes": id = UTF-8 byte value, specials above 255
    vocab_size: int
    eos_token_id: int
    bos_token_id: int  # -1: none

    @classmethod
    def from_json(cls, t: JsonFields) -> TokenizerSpec:
        t.allow_only(*(f.name for f in fields(cls)))
        vocab_size = t.integer("vocab_size", 257)
        eos = t.integer("eos_token_id", 256)
        bos = t.raw("bos_token_id")
        if bos != -1:
            bos = t.integer("bos_token_id", 256)
        if eos >= vocab_size or bos >= vocab_size or bos == eos:
            raise t.fail("eos_token_id", f"and bos_token_id must be distinct special ids < vocab_size {vocab_size}")
        return cls(BYTES, vocab_size, eos, bos)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


TOKENIZERS: dict[str, type[TokenizerSpec]] = {BYTES: TokenizerSpec}


def parse_tokenizer(t: JsonFields) -> TokenizerSpec:
    kind = t.text("kind")
    if kind not in TOKENIZERS:
        raise t.fail("kind", f"must be {one_of(TOKENIZERS)} (the tokenizers this worker serves), got {kind!r}")
    return TOKENIZERS[kind].from_json(t)
