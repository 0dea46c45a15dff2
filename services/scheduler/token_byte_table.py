"""The exact bytes each token id contributes to the text, read from a tokenizer.json's decoder.

A stream turns token ids into text one id at a time (output_stream.py), so it needs every id's
bytes on their own. HF tokenizers decode whole sequences instead; this module maps the decoders
that are per-token byte maps underneath, and refuses the rest by name:

- ByteLevel (GPT-2, Llama 3, Qwen2): each character of a token stands for one byte (GPT-2's
  bytes_to_unicode table); a token with a character outside the table (an added token such as
  "hello there") is its own UTF-8, as the Rust decoder does.
- SentencePiece with byte fallback (Llama 2, Mistral): a token spelled exactly `<0xNN>` is that
  byte, the replacement character `▁` is a space, anything else is its UTF-8. Either as a
  Sequence of Replace, ByteFallback, Fuse, Strip (in that order) or as a Metaspace decoder.

Special tokens (and ids the tokenizer does not know, e.g. an embedding padded past the
vocabulary) carry no text: a stream shows what `decode(..., skip_special_tokens=True)` shows.

Two differences from `tokenizers.decode`, both because a stream is a continuation of its prompt
and is decoded byte-wise (see docs/ARCHITECTURE.md, "Tokenization"):
- SentencePiece decoders strip one leading space from the start of the decoded text (the space
  the encoder prepended). Here `▁Paris` is always " Paris": generated text continues the prompt,
  where that space is real. `strips_leading_space` records that the decoder does this.
- Invalid UTF-8 becomes U+FFFD per maximal invalid subsequence (Python's and Rust's
  from_utf8_lossy rule, which ByteLevel uses too); ByteFallback instead replaces every byte of
  a run of `<0xNN>` tokens that is not valid UTF-8 as a whole. Valid text is identical.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SPIECE_UNDERLINE = "\u2581"  # "▁", SentencePiece's stand-in for a space


class UnmappableDecoder(ValueError):
    """tokenizer.json's decoder is not a per-token byte map this module knows."""


@dataclass(frozen=True)
class TokenByteTable:
    # by_id[i]: the bytes token i contributes; b"" for special and unknown ids.
    by_id: tuple[bytes, ...]
    # The decoder strips one leading space from the whole text (SentencePiece); streams keep it.
    strips_leading_space: bool
    # What the decoder was, for messages: "ByteLevel" or "SentencePiece (byte fallback)".
    decoder_name: str


def _gpt2_char_to_byte() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: printable Latin-1 bytes stand for themselves, the
    rest are shifted to U+0100 and up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


_BYTE_LEVEL_CHARS = _gpt2_char_to_byte()


def _byte_level(token: str) -> bytes:
    try:
        return bytes(_BYTE_LEVEL_CHARS[c] for c in token)
    except KeyError:  # an added token written as plain text
        return token.encode("utf-8")


def _fallback_byte(token: str) -> int | None:
    """The byte a `<0xNN>` token stands for (either hex case, as the Rust decoder reads it)."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return int(token[3:5], 16)
        except ValueError:
            return None
    return None


@dataclass(frozen=True)
class _SentencePiecePlan:
    replacements: tuple[tuple[str, str], ...]
    byte_fallback: bool
    strips_leading_space: bool

    def token_bytes(self, token: str) -> bytes:
        for old, new in self.replacements:  # Replace runs before ByteFallback, as in the Sequence
            token = token.replace(old, new)
        if self.byte_fallback and (byte := _fallback_byte(token)) is not None:
            return bytes((byte,))
        return token.encode("utf-8")


def _metaspace(step: Mapping[str, Any]) -> tuple[tuple[str, str], bool]:
    """A Metaspace decoder's replacement and whether it strips the first token's leading one."""
    replacement = step.get("replacement", SPIECE_UNDERLINE)
    if not isinstance(replacement, str) or len(replacement) != 1:
        raise UnmappableDecoder(f"Metaspace decoder with replacement {replacement!r} (want one character)")
    if "prepend_scheme" in step:
        scheme = step["prepend_scheme"]
        if scheme not in ("first", "always", "never"):
            raise UnmappableDecoder(f"Metaspace decoder with prepend_scheme {scheme!r}")
        strips = scheme != "never"
    else:  # tokenizers < 0.15 wrote add_prefix_space instead
        strips = bool(step.get("add_prefix_space", True))
    return (replacement, " "), strips


def _sentencepiece_plan(steps: Sequence[Mapping[str, Any]]) -> _SentencePiecePlan:
    """Replace*, ByteFallback?, Fuse?, Strip? in that order, or a Metaspace among them."""
    replacements: list[tuple[str, str]] = []
    byte_fallback = fused = strips = False
    for i, step in enumerate(steps):
        kind = step.get("type")
        where = f"decoders[{i}] ({kind})"
        if kind == "Replace":
            pattern = step.get("pattern", {})
            if byte_fallback or fused or "String" not in pattern or not isinstance(step.get("content"), str):
                raise UnmappableDecoder(f"{where}: only a plain-string Replace before ByteFallback and Fuse maps "
                                        f"to bytes per token, got {dict(step)}")
            replacements.append((pattern["String"], step["content"]))
        elif kind == "Metaspace":
            if byte_fallback or fused:
                raise UnmappableDecoder(f"{where}: Metaspace after ByteFallback or Fuse")
            replacement, strips = _metaspace(step)
            replacements.append(replacement)
        elif kind == "ByteFallback" and not (byte_fallback or fused):
            byte_fallback = True
        elif kind == "Fuse" and not fused:
            fused = True
        elif kind == "Strip":
            if not fused or step.get("stop", 0) != 0 or step.get("start", 0) > 1 or step.get("content") != " ":
                raise UnmappableDecoder(f"{where}: only Strip(content=' ', start<=1, stop=0) after Fuse maps to "
                                        f"bytes per token, got {dict(step)}")
            strips = strips or step.get("start", 0) == 1
        else:
            raise UnmappableDecoder(f"{where} is not one of Replace, Metaspace, ByteFallback, Fuse, Strip "
                                    "in that order")
    if not replacements:
        raise UnmappableDecoder("a SentencePiece-style decoder with no Replace or Metaspace step "
                                f"(no way to read {SPIECE_UNDERLINE!r} as a space)")
    return _SentencePiecePlan(tuple(replacements), byte_fallback, strips)


def _per_token(decoder: Mapping[str, Any] | None) -> tuple[Callable[[str], bytes], bool, str]:
    if decoder is None:
        raise UnmappableDecoder("tokenizer.json has no decoder (tokens would be joined by spaces)")
    kind = decoder.get("type")
    steps = decoder.get("decoders") if kind == "Sequence" else [decoder]
    if not isinstance(steps, list) or not all(isinstance(s, dict) for s in steps):
        raise UnmappableDecoder(f"decoder {kind!r} has no list of decoders")
    if [s.get("type") for s in steps] == ["ByteLevel"]:
        return _byte_level, False, "ByteLevel"
    kinds = {s.get("type") for s in steps}
    if kinds <= {"Replace", "Metaspace", "ByteFallback", "Fuse", "Strip"}:
        plan = _sentencepiece_plan(steps)
        name = "SentencePiece (byte fallback)" if plan.byte_fallback else "SentencePiece"
        return plan.token_bytes, plan.strips_leading_space, name
    found = ", ".join(str(s.get("type")) for s in steps)
    raise UnmappableDecoder(
        f"decoder {found} has no exact per-token byte map here; supported: ByteLevel, or SentencePiece "
        "(Replace '▁' -> ' ', ByteFallback, Fuse, Strip; or Metaspace)")


def token_byte_table(decoder: Mapping[str, Any] | None, tokens: Sequence[str | None],
                     special_ids: frozenset[int]) -> TokenByteTable:
    """`tokens[i]`: token i as the tokenizer spells it (None: no such id); `decoder`: tokenizer.json's
    "decoder" object. UnmappableDecoder names what was found when it is not a per-token byte map."""
    token_bytes, strips, name = _per_token(decoder)
    by_id = tuple(b"" if token is None or i in special_ids else token_bytes(token) for i, token in enumerate(tokens))
    return TokenByteTable(by_id, strips, name)
