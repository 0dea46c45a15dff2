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
    return grammar


def _checked(build) -> str:
    try:
        return build()
    except ValueError as exc:
        raise errors.InvalidArgument(f"sampling.structured: invalid json_schema: {exc}") from None
