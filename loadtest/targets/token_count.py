"""Counting output tokens when a server does not say how many it sent (no `usage`).

The scenario's `tokenizer`:
  bytes            one UTF-8 byte is one token (the demo models' byte-level vocabulary; the default)
  hf:PATH          a Hugging Face tokenizer.json read from disk (the `tokenizers` package); nothing is downloaded
"""

from __future__ import annotations

from typing import Protocol


class TokenCounter(Protocol):
    def count(self, text: str) -> int: ...


class ByteCounter:
    def count(self, text: str) -> int:
        return len(text.encode("utf-8"))


class HfCounter:
    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        try:
            self._tokenizer = Tokenizer.from_file(path)
        except Exception as err:  # tokenizers raises its own Exception for a missing or bad file
            raise ValueError(f"tokenizer: cannot load {path}: {err}") from None

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)


def token_counter(spec: str) -> TokenCounter:
    if spec == "bytes":
        return ByteCounter()
    if spec.startswith("hf:") and spec[3:]:
        return HfCounter(spec[3:])
    raise ValueError(f"tokenizer must be 'bytes' or 'hf:PATH/tokenizer.json', got {spec!r}")
