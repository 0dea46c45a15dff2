"""TOKENIZER_KIND_HF: a model's own tokenizer.json run by HF's Rust `tokenizers`, behind the
scheduler's Tokenizer protocol.

Built once per model version when its first worker attaches (the hello carries the file's
bytes, see docs/ARCHITECTURE.md "Tokenization"); every check that can fail does so then, so a
tokenizer that would mis-serve is refused before any request reaches it:
- the decoder maps to exact per-token bytes (token_byte_table.py), or the message names it;
- every id the tokenizer can produce has a row in the model's output layer (config.json's
  vocab_size); a model padded past the tokenizer is fine, the padding ids carry no text;
- the named special tokens (tokenizer_config.json's bos_token, eos_token, ...) are tokens of
  tokenizer.json, so the chat template's text and the ids agree.

BOS/EOS on encode follow transformers: tokenizer.json's post-processor, unless
tokenizer_config.json sets add_bos_token or add_eos_token, which rebuild it (as
PreTrainedTokenizerFast.update_post_processor does). A rendered chat template already holds its
special tokens, so it is encoded with add_special_tokens=False, as apply_chat_template does.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from tokenizers import Tokenizer as RustTokenizer
from tokenizers import processors

from services.scheduler.token_byte_table import TokenByteTable, UnmappableDecoder, token_byte_table

TOKENIZER_FILE = "tokenizer.json"
MODEL_CONFIG_FILE = "config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class TokenizerRefused(ValueError):
    """The tokenizer files cannot serve this model; the message names the file, field and values."""


@dataclass(frozen=True)
class HFTokenizerSource:
    """What a model's tokenizer is made of, as its worker declares it (TokenizerSpec, kind HF)."""

    tokenizer_json: bytes
    # config.json's vocab_size: the ids the model's output layer produces.
    vocab_size: int
    eos_token_id: int
    # generation_config.json's further end-of-sequence ids (Llama 3 Instruct's <|eot_id|>).
    stop_token_ids: tuple[int, ...] = ()
    # tokenizer_config.json's add_bos_token / add_eos_token; None: the file does not set it.
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None
    # Named special tokens as tokenizer_config.json spells them: bos_token, eos_token, unk_token, ...
    special_tokens: Mapping[str, str] = field(default_factory=dict)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.tokenizer_json).hexdigest()


class HFTokenizer:
    """Encode with the model's tokenizer; exact bytes per id for streams (output_stream.py)."""

    def __init__(self, source: HFTokenizerSource) -> None:
        self._rust = _load(source.tokenizer_json)
        self._vocab_size = source.vocab_size
        self._eos_token_id = source.eos_token_id
        token_ids = self._rust.get_vocab(with_added_tokens=True)
        num_ids = max(token_ids.values(), default=-1) + 1
        _check_vocab_size(num_ids, len(token_ids), source.vocab_size)
        if not 0 <= source.eos_token_id < num_ids:
            raise TokenizerRefused(f"eos_token_id {source.eos_token_id} is not a token of {TOKENIZER_FILE} "
                                   f"(ids 0..{num_ids - 1})")
        bad_stops = [i for i in source.stop_token_ids if not 0 <= i < source.vocab_size]
        if bad_stops:
            raise TokenizerRefused(f"stop_token_ids {bad_stops} are outside the vocabulary [0, {source.vocab_size})")
        self._end_token_ids = frozenset((source.eos_token_id, *source.stop_token_ids))
        named = _named_special_ids(source.special_tokens, token_ids)
        _set_bos_eos(self._rust, source, named)
        self.special_token_ids = frozenset(
            i for i, token in self._rust.get_added_tokens_decoder().items() if token.special
        ) | frozenset(named.values()) | {source.eos_token_id}
        try:
            self._table: TokenByteTable = token_byte_table(
                json.loads(source.tokenizer_json).get("decoder"),
                [self._rust.id_to_token(i) for i in range(num_ids)] + [None] * (source.vocab_size - num_ids),
                self.special_token_ids,
            )
        except UnmappableDecoder as exc:
            raise TokenizerRefused(f"{TOKENIZER_FILE}: {exc}") from None
        self.sha256 = source.sha256

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_id(self) -> int:
        return self._eos_token_id

    @property
    def end_token_ids(self) -> frozenset[int]:
        return self._end_token_ids

    @property
    def decoder_name(self) -> str:
        return self._table.decoder_name

    @property
    def strips_leading_space(self) -> bool:
        """tokenizers' decode drops the text's first space; streams keep it (token_byte_table.py)."""
        return self._table.strips_leading_space

    def encode(self, text: str, *, add_special_tokens: bool = True) -> tuple[int, ...]:
        return tuple(self._rust.encode(text, add_special_tokens=add_special_tokens).ids)

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self._vocab_size:
            raise ValueError(f"token id {token_id} outside the vocabulary [0, {self._vocab_size})")
        return self._table.by_id[token_id]

    def decode(self, token_ids: Iterable[int]) -> str:
        """Text of `token_ids` as a stream shows it (special tokens carry none; invalid UTF-8 is U+FFFD)."""
        return b"".join(self.token_bytes(t) for t in token_ids).decode("utf-8", errors="replace")


def _load(tokenizer_json: bytes) -> RustTokenizer:
    try:
        rust = RustTokenizer.from_str(tokenizer_json.decode("utf-8"))
    except Exception as exc:  # tokenizers raises a bare Exception for JSON it cannot read
        raise TokenizerRefused(f"{TOKENIZER_FILE} does not load: {exc}") from None
    # A prompt is never cut or padded behind the caller's back: too long is refused with both lengths.
    rust.no_truncation()
    rust.no_padding()
    return rust


def _check_vocab_size(num_ids: int, num_tokens: int, vocab_size: int) -> None:
    if vocab_size < 1:
        raise TokenizerRefused(f"{MODEL_CONFIG_FILE} vocab_size must be >= 1, got {vocab_size}")
    if num_ids > vocab_size:
        raise TokenizerRefused(
            f"{TOKENIZER_FILE} has ids up to {num_ids - 1} ({num_tokens} tokens with its added tokens) but "
            f"{MODEL_CONFIG_FILE} vocab_size is {vocab_size}: ids from {vocab_size} on have no row in the "
            "model's embedding and output layer"
        )


def _named_special_ids(special_tokens: Mapping[str, str], token_ids: Mapping[str, int]) -> dict[str, int]:
    ids = {}
    for name, token in special_tokens.items():
        if token not in token_ids:
            raise TokenizerRefused(f"{TOKENIZER_CONFIG_FILE} {name} {token!r} is not a token of {TOKENIZER_FILE}")
        ids[name] = token_ids[token]
    return ids


def _set_bos_eos(rust: RustTokenizer, source: HFTokenizerSource, named: Mapping[str, int]) -> None:
    """tokenizer_config.json's add_bos_token/add_eos_token, when set, rebuild the post-processor
    exactly as transformers does; unset, tokenizer.json's own post-processor decides."""
    if source.add_bos_token is None and source.add_eos_token is None:
        return
    bos = source.special_tokens.get("bos_token") if source.add_bos_token else None
    eos = source.special_tokens.get("eos_token") if source.add_eos_token else None
    single = f"{(bos + ':0 ') if bos else ''}$A:0{(' ' + eos + ':0') if eos else ''}"
    pair = f"{single}{(' ' + bos + ':1') if bos else ''} $B:1{(' ' + eos + ':1') if eos else ''}"
    special = [(token, named[name]) for name, token in (("bos_token", bos), ("eos_token", eos)) if token]
    try:
        rust.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
    except Exception as exc:  # tokenizers raises bare Exceptions; e.g. a special token without its name's id
        raise TokenizerRefused(f"{TOKENIZER_CONFIG_FILE} add_bos_token/add_eos_token: cannot build the "
                               f"post-processor {single!r}: {exc}") from None
