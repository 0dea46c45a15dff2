"""SamplingParams.structured -> the llguidance grammar the worker constrains sampling with.

Compiled and checked once, at admission (an invalid schema, regex or grammar is the caller's error, named
here, not a failure mid-stream); the worker gets the compiled grammar with each step of the
sequence (SequenceStep.grammar). llguidance over xgrammar: it installs from PyPI as one small
wheel with no dependencies (no torch, no compiler), builds its tokenizer from tokenizer.json or a
byte table alone, and computes a token mask in microseconds on a CPU (docs/clients.md).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import llguidance

from services.common import errors

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the type stub only

MAX_CHOICES = 256
# JSON as json.dumps writes it, with no other whitespace: with whitespace free, a model may pad with
# spaces or newlines until max_tokens and never close the value (small models do, often).
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SPEC_BYTES = 64 * 1024  # a schema, regex, grammar or all choices together, UTF-8


def compile_grammar(kind: str, spec: str | list[str]) -> str:
    """The grammar for `kind` json_schema (spec: its JSON text), json_object, regex, grammar (Lark or
    GBNF/EBNF text) or choice (spec: the strings); InvalidArgument naming sampling.structured and the
    problem."""
    size = len(spec.encode()) if isinstance(spec, str) else sum(len(c.encode()) for c in spec)
    if size > MAX_SPEC_BYTES:
        raise errors.InvalidArgument(f"sampling.structured: the {kind} is {size} bytes; at most {MAX_SPEC_BYTES}")
    if kind == "json_schema":
        assert isinstance(spec, str)
        try:
            schema = json.loads(spec)
        except ValueError as exc:
            raise errors.InvalidArgument(f"sampling.structured: json_schema is not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise errors.InvalidArgument("sampling.structured: json_schema must be a JSON object")
        grammar = _checked(lambda: llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS))
    elif kind == "json_object":
        grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    elif kind == "regex":
        assert isinstance(spec, str)
        grammar = llguidance.LLMatcher.grammar_from_regex(spec)
    elif kind == "grammar":
        assert isinstance(spec, str)
        try:  # Lark as it is; GBNF/EBNF converted to Lark (vLLM's guided_grammar through llguidance)
            grammar = llguidance.grammar_from("grammar", spec)
        except ValueError as exc:
            raise errors.InvalidArgument(f"sampling.structured: invalid grammar: {exc}") from None
    elif kind == "choice":
        if not spec or len(spec) > MAX_CHOICES or not all(spec):
            raise errors.InvalidArgument(f"sampling.structured: choice needs 1 to {MAX_CHOICES} non-empty strings")
        # A Lark alternation of JSON-quoted literals: each choice exactly, nothing else.
        grammar = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
    else:
        raise errors.InvalidArgument(f"sampling.structured: unknown kind {kind!r}")
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem and not problem.startswith("WARNING"):
        raise errors.InvalidArgument(f"sampling.structured: invalid {kind}: {problem.strip()}")
    if kind in ("grammar", "regex"):
        _check_matches_some_string(kind, grammar)
    return grammar


class _ByteTokens:
    """A tokenizer of the 256 bytes and an end of sequence, as llguidance.TokenizerWrapper reads one:
    every string is a sequence of its tokens, whatever the model's tokenizer."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b""]
    special_token_ids = [256]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


_BYTE_TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens()))


def _check_matches_some_string(kind: str, grammar: str) -> None:
    """validate_grammar takes a grammar whose every rule needs itself (`start: start`) or a class of no
    character; its matcher is in error from the start, which a worker read as the output's end (the
    client got "" as a whole answer). Over bytes, no first byte is allowed exactly when no string
    matches. About 0.5 ms; not for JSON schemas (llguidance refuses an unsatisfiable one itself)."""
    matcher = llguidance.LLMatcher(_BYTE_TOKENIZER, grammar, log_level=0)
    if matcher.is_error():
        raise errors.InvalidArgument(f"sampling.structured: invalid {kind}: {matcher.get_error().strip()}")
    matcher.compute_bitmask()
    if matcher.is_error():
        raise errors.InvalidArgument(f"sampling.structured: invalid {kind}: it matches no string (each way "
                                     "through it needs a rule that never ends, or an empty character class)")


def _checked(build) -> str:
    try:
        return build()
    except ValueError as exc:
        raise errors.InvalidArgument(f"sampling.structured: invalid json_schema: {exc}") from None
