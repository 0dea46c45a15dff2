"""Text <-> token ids for generator models, as the worker's TokenizerSpec describes.

TOKENIZER_KIND_BYTES lives here: a token id below 256 is that byte of the UTF-8
text; ids from 256 up are special (end-of-sequence, beginning-of-sequence) and
carry no text. TOKENIZER_KIND_HF (a model's tokenizer.json) is hf_tokenizer.py.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

NUM_BYTE_TOKENS = 256


class Tokenizer(Protocol):
    """What the step scheduler needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_id(self) -> int: ...

    @property
    def end_token_ids(self) -> frozenset[int]:
        """Every id that ends a sequence (never streamed unless ignore_eos): eos_token_id and the
        model's further stop ids (TokenizerSpec.stop_token_ids)."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> tuple[int, ...]:
        """Token ids of `text`; add_special_tokens=False for text that already holds them (a
        rendered chat template), as transformers' apply_chat_template encodes."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """UTF-8 bytes the token contributes to the text; b"" for special tokens."""
        ...


@dataclass(frozen=True)
class ByteTokenizer:
    """TOKENIZER_KIND_BYTES: token id = byte value; special ids at 256 and above."""

    vocab_size: int
    eos_token_id: int
    # Prepended to every prompt; None when the model has none (the wire's -1).
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.vocab_size <= NUM_BYTE_TOKENS:
            raise ValueError(f"vocab_size must exceed {NUM_BYTE_TOKENS} (room for special ids), got {self.vocab_size}")
        for name, token_id in (("eos_token_id", self.eos_token_id), ("bos_token_id", self.bos_token_id)):
            if token_id is not None and not NUM_BYTE_TOKENS <= token_id < self.vocab_size:
                raise ValueError(
                    f"{name} must be a special id in [{NUM_BYTE_TOKENS}, {self.vocab_size}), got {token_id}"
                )

    @classmethod
    def from_spec(cls, *, vocab_size: int, eos_token_id: int, bos_token_id: int) -> ByteTokenizer:
        """From TokenizerSpec's fields (bos_token_id -1 means none)."""
        return cls(vocab_size, eos_token_id, None if bos_token_id < 0 else bos_token_id)

    @property
    def end_token_ids(self) -> frozenset[int]:
        return frozenset((self.eos_token_id,))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> tuple[int, ...]:
        prefix = () if self.bos_token_id is None or not add_special_tokens else (self.bos_token_id,)
        return prefix + tuple(text.encode("utf-8"))

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} outside the vocabulary [0, {self.vocab_size})")
        return bytes((token_id,)) if token_id < NUM_BYTE_TOKENS else b""

    def decode(self, token_ids: Iterable[int]) -> str:
        """Whole text of `token_ids`; invalid UTF-8 becomes U+FFFD."""
        return b"".join(self.token_bytes(t) for t in token_ids).decode("utf-8", errors="replace")


class IncrementalDetokenizer:
    """Turns a growing token stream into text, holding back the bytes of an incomplete character.

    Concatenating every `push` result and the final `flush` equals decoding the
    whole stream at once.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: Sequence[int]) -> str:
        data = b"".join(self._tokenizer.token_bytes(t) for t in token_ids)
        return self._decoder.decode(data, final=False)

    def flush(self) -> str:
        """Text of held-back bytes at the end of the stream (U+FFFD if they never completed)."""
        return self._decoder.decode(b"", final=True)
