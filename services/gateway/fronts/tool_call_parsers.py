"""Tool calls out of a model's text, one parser per format (tool_call_formats.py names them), as
vLLM's tool parsers: for tool_choice auto, where the model was free to call or to answer.

A parser says two things: how much of a growing text is surely content (streamed at once; the
rest is held until the end, as it may be a call), and, given the whole text, its calls and the
content around them. A text whose calls do not parse is all content, as in vLLM: the client sees
what the model wrote rather than a made-up call.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from services.common.tool_call_formats import GRANITE, HERMES, LLAMA3_JSON, MISTRAL, PYTHONIC, QWEN3_CODER
from services.gateway.fronts.partial_tags import partial_tag_len


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI's function.arguments


@dataclass(frozen=True)
class Parsed:
    content: str  # the text that is not a call ("" when the reply is calls alone)
    calls: tuple[ParsedCall, ...]


class ToolCallParser(Protocol):
    def content_end(self, text: str) -> int:
        """How much of `text` (a reply so far) is content whatever comes next: text[:end] can be
        streamed. Never less for a longer text that begins with this one."""
        ...

    def parse(self, text: str) -> Parsed:
        """The whole reply's calls and content; text[:content_end(text)] begins the content."""
        ...


def call_from_object(value: Any, arguments_key: str) -> ParsedCall | None:
    """{"name": ..., <arguments_key>: {...}} as a call; None when it is not one. A model that wrote
    the other key (arguments / parameters) is read too."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    other = "parameters" if arguments_key == "arguments" else "arguments"
    arguments = value.get(arguments_key, value.get(other, {}))
    if isinstance(arguments, str):
        return ParsedCall(value["name"], arguments)
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` per call, after any content (Hermes,
    Qwen2.5). A last call the end of the reply cut before its closing tag is read too."""

    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def content_end(self, text: str) -> int:
        start = text.find(self.START)
        if start >= 0:
            return start
        return len(text) - partial_tag_len(text, self.START)  # a tag's beginning is held

    def parse(self, text: str) -> Parsed:
        start = text.find(self.START)
        if start < 0:
            return Parsed(text, ())
        calls = []
        for match in self._CALL.finditer(text, start):
            call = call_from_object(_json_or_none(match.group(1).strip()), "arguments")
            if call is None:
                return Parsed(text, ())
            calls.append(call)
        return Parsed(text[:start], tuple(calls))


class Llama3JsonParser:
    """The whole reply is one call `{"name": ..., "parameters": {...}}` (or several, `;` between
    them), optionally after <|python_tag|> (Llama 3.1+ JSON tool calling). A reply that begins any
    other way is content."""

    PYTHON_TAG = "<|python_tag|>"

    def content_end(self, text: str) -> int:
        head = text.lstrip()
        if not head or head.startswith("{") or head.startswith(self.PYTHON_TAG) or self.PYTHON_TAG.startswith(head):
            return 0  # may be a call: held to the end
        return len(text)

    def parse(self, text: str) -> Parsed:
        body = text.strip().removeprefix(self.PYTHON_TAG).lstrip()
        if not body.startswith("{"):
            return Parsed(text, ())
        decoder, position, calls = json.JSONDecoder(), 0, []
        while position < len(body):
            try:
                value, position = decoder.raw_decode(body, position)
            except ValueError:
                return Parsed(text, ())
            call = call_from_object(value, "parameters")
            if call is None:
                return Parsed(text, ())
            calls.append(call)
            while position < len(body) and body[position] in " \t\r\n;":
                position += 1
        return Parsed("", tuple(calls))


class JsonArrayParser:
    """The reply is a JSON array of `{"name": ..., "arguments": {...}}` calls (one object is read as
    one call), after one of `markers` or not: the marker is a special token, which the detokenizer
    drops from the text, so a reply that begins with `[` is read the same. Text before a marker is
    content; a reply that is not such an array is all content (Granite 3's `<|tool_call|>`, Mistral's
    `[TOOL_CALLS]`, as vLLM's granite and mistral parsers read them)."""

    def __init__(self, *markers: str) -> None:
        self.markers = markers

    def _marker(self, text: str) -> tuple[int, int]:
        """Where the first marker in `text` begins and ends; (-1, -1) when there is none."""
        found = [(at, at + len(m)) for m in self.markers if (at := text.find(m)) >= 0]
        return min(found, default=(-1, -1))

    def content_end(self, text: str) -> int:
        start, _ = self._marker(text)
        if start >= 0:
            return start
        head = text.lstrip()
        if not head or head.startswith(("[", "{")):
            return 0  # may be a call (one object is read as one): held to the end
        return len(text) - partial_tag_len(text, *self.markers)  # a marker's beginning is held

    def parse(self, text: str) -> Parsed:
        start, end = self._marker(text)
        content, body = (text[:start], text[end:]) if start >= 0 else ("", text)
        value = _json_or_none(body.strip()) if body.strip().startswith(("[", "{")) else None
        items = [value] if isinstance(value, dict) else value
        if not isinstance(items, list) or not items:
            return Parsed(text, ())
        calls = [call_from_object(item, "arguments") for item in items]
        if any(call is None for call in calls):
            return Parsed(text, ())
        return Parsed(content, tuple(c for c in calls if c is not None))


class MistralParser:
    """Mistral's two forms, as vLLM's mistral parser reads them: tokenizer v3's JSON array of calls
    after [TOOL_CALLS] (read as JsonArrayParser reads it), and v11+'s `name[ARGS]{...}` per call, each
    after its own [TOOL_CALLS] (Mistral Small 3.1/3.2, Magistral, Devstral). Both markers are special
    tokens, which the detokenizer drops, so `name{...}name{...}` reads the same, and a `[CALL_ID]id`
    before [ARGS] is skipped where the text keeps the markers (where it drops them the id runs into
    the name: not told apart). Content before a call is told only by a [TOOL_CALLS] in the text:
    without one, a reply that does not begin with a call is all content."""

    MARKER, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    # A v11 call up to its arguments' "{": a name (OpenAI's characters), then the markers the text kept.
    _NAMED_CALL = re.compile(r"\s*(?:\[TOOL_CALLS\])?\s*(?P<name>[A-Za-z0-9_-]+)"
                             r"(?:\[CALL_ID\][A-Za-z0-9]*)?(?:\[ARGS\])?(?=\{)")
    _NAME_SO_FAR = re.compile(r"[A-Za-z0-9_-]+(?:\[CALL_ID\][A-Za-z0-9]*)?(?:\[ARGS\])?")

    def __init__(self) -> None:
        self._array = JsonArrayParser(self.MARKER)

    def content_end(self, text: str) -> int:
        start = text.find(self.MARKER)
        if start >= 0:
            return start
        head = text.lstrip()
        if not head or head.startswith(("[", "{")) or self._may_begin_named_call(head):
            return 0  # may be a call: held to the end
        return len(text) - partial_tag_len(text, self.MARKER)

    def parse(self, text: str) -> Parsed:
        start = text.find(self.MARKER)
        content, body = (text[:start], text[start + len(self.MARKER):]) if start >= 0 else ("", text)
        if body.lstrip().startswith(("[", "{")):
            return self._array.parse(text)
        calls = self._named_calls(body)
        return Parsed(content, calls) if calls else Parsed(text, ())

    def _may_begin_named_call(self, head: str) -> bool:
        """Whether `head` (a reply so far, without a marker) may still grow into a v11 call: a name so
        far, then what the text kept of the markers, then the arguments' "{" or nothing yet."""
        match = self._NAME_SO_FAR.match(head)
        if match is None:
            return False
        rest = head[match.end():]
        return not rest or rest.startswith("{") or self.ARGS.startswith(rest) or self.CALL_ID.startswith(rest)

    def _named_calls(self, body: str) -> tuple[ParsedCall, ...]:
        """`body` as v11 calls one after another, each an object of arguments; () unless it is wholly that."""
        decoder, position, calls = json.JSONDecoder(), 0, []
        while body[position:].strip():
            match = self._NAMED_CALL.match(body, position)
            if match is None:
                return ()
            try:
                arguments, position = decoder.raw_decode(body, match.end())
            except ValueError:
                return ()
            if not isinstance(arguments, dict):
                return ()
            calls.append(ParsedCall(match["name"], json.dumps(arguments, ensure_ascii=False)))
        return tuple(calls)


class Qwen3CoderParser:
    """`<tool_call><function=NAME><parameter=P>text</parameter>...</function></tool_call>` per call
    (a line break after each tag), after any content (Qwen3-Coder), as vLLM's qwen3_coder parser
    reads it: a parameter's text is typed by its tool's JSON schema (`typed_parameter`). A
    <function=...> without its <tool_call>, a </parameter> left out before the next parameter, and a
    last call the end of the reply cut before its closing tags are read too. Text after the calls
    makes the reply content."""

    STARTS = ("<tool_call>", "<function=")
    _CALL = re.compile(r"\s*(?:<tool_call>\s*)?<function=(?P<name>[^>\n]+)>(?P<body>.*?)"
                       r"(?:</function>\s*(?:</tool_call>)?|</tool_call>|\Z)", re.DOTALL)
    _PARAMETER = re.compile(r"\s*<parameter=(?P<name>[^>\n]+)>(?P<value>.*?)(?:</parameter>|(?=<parameter=)|\Z)",
                            re.DOTALL)

    def __init__(self, schemas: Mapping[str, dict]) -> None:
        self._schemas = schemas  # the request's tools' parameter schemas, by name

    def content_end(self, text: str) -> int:
        start = self._start(text)
        if start >= 0:
            return start
        return len(text) - partial_tag_len(text, *self.STARTS)  # a tag's beginning is held

    def parse(self, text: str) -> Parsed:
        start = self._start(text)
        if start < 0:
            return Parsed(text, ())
        position, calls = start, []
        while text[position:].strip():
            match = self._CALL.match(text, position)
            call = self._call(match["name"].strip(), match["body"]) if match is not None else None
            if match is None or call is None:
                return Parsed(text, ())
            calls.append(call)
            position = match.end()
        return Parsed(text[:start], tuple(calls))

    def _start(self, text: str) -> int:
        found = [at for tag in self.STARTS if (at := text.find(tag)) >= 0]
        return min(found, default=-1)

    def _call(self, name: str, body: str) -> ParsedCall | None:
        """One function element's parameters as a call; None unless `body` is wholly parameters."""
        schema = self._schemas.get(name)
        properties = schema.get("properties") if isinstance(schema, dict) else None
        properties = properties if isinstance(properties, dict) else {}
        arguments, position = {}, 0
        while body[position:].strip():
            match = self._PARAMETER.match(body, position)
            if match is None:
                return None
            value = match["value"].removeprefix("\n").removesuffix("\n")  # the template's own line breaks
            arguments[match["name"].strip()] = typed_parameter(value, properties.get(match["name"].strip()))
            position = match.end()
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


def typed_parameter(text: str, schema: Any) -> Any:
    """A qwen3_coder parameter's text as the JSON value its schema's type asks for, as vLLM types it:
    "null" is null whatever the type; integer, number and boolean as their literals; object and array
    as JSON (or a Python literal of one); text that does not read as its type, and a parameter of
    another type or none (one its tool's schema does not name), stays a string. Unlike vLLM, a
    boolean that reads as neither true nor false stays a string rather than becoming false."""
    if text.lower() == "null":
        return None
    kind = _schema_type(schema)
    if kind == "integer":
        return _number(text, integer=True)
    if kind == "number":
        return _number(text, integer=False)
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.strip().lower(), text)
    if kind in ("object", "array"):
        try:
            return json.loads(text)
        except ValueError:
            pass
        try:
            return _as_json(ast.literal_eval(text.strip()))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return text
    return text


def _schema_type(schema: Any) -> str:
    """A property schema's one type ("" where it names none); of a list of types, the first but null."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind if isinstance(kind, str) else ""


def _number(text: str, integer: bool) -> Any:
    """`text` as an int, or (integer false) an int or a finite float (a whole one as an int, as vLLM);
    `text` itself when it is not one."""
    try:
        return int(text)
    except ValueError:
        if integer:
            return text
    try:
        value = float(text)
    except ValueError:
        return text
    if not math.isfinite(value):
        return text  # JSON has no NaN or infinity
    return int(value) if value.is_integer() else value


class PythonicParser:
    """The whole reply is a Python list of calls, `[get_weather(city="Paris", unit="c"), clock()]`
    (Llama 3.2 and Llama 4 with their pythonic templates, ToolACE), as vLLM's pythonic parser reads
    it; Llama 4's <|python_start|> around it is a special token, dropped. Read with `ast`, never run:
    each call is a plain name with keyword arguments, each a literal (strings, numbers, True, False,
    None, and lists, tuples and dicts of them). A reply that is anything else is content."""

    def content_end(self, text: str) -> int:
        head = text.lstrip()
        if not head or head.startswith("["):
            return 0  # may be a call: held to the end
        return len(text)

    def parse(self, text: str) -> Parsed:
        try:
            tree = ast.parse(text.strip(), mode="eval")
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return Parsed(text, ())
        elements = tree.body.elts if isinstance(tree.body, ast.List) else []
        calls = [_pythonic_call(element) for element in elements]
        if not calls or any(call is None for call in calls):
            return Parsed(text, ())
        return Parsed("", tuple(c for c in calls if c is not None))


def _pythonic_call(node: ast.expr) -> ParsedCall | None:
    """`name(key=literal, ...)` as a call; None for any other expression (positional or ** arguments,
    a call of an attribute or of a call, a value that is not a literal JSON can hold)."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            return None
        try:
            arguments[keyword.arg] = _as_json(ast.literal_eval(keyword.value))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    return ParsedCall(node.func.id, json.dumps(arguments, ensure_ascii=False))


def _as_json(value: Any) -> Any:
    """A Python literal as JSON reads it back (tuples as lists); ValueError or TypeError where JSON
    has no such value (bytes, sets, complex numbers, NaN)."""
    return json.loads(json.dumps(value, ensure_ascii=False, allow_nan=False))


PARSERS: dict[str, ToolCallParser] = {
    HERMES: HermesParser(), LLAMA3_JSON: Llama3JsonParser(), GRANITE: JsonArrayParser("<|tool_call|>", "<tool_call>"),
    MISTRAL: MistralParser(), PYTHONIC: PythonicParser(),
}


def parser_for(name: str, schemas: Mapping[str, dict]) -> ToolCallParser | None:
    """Format `name`'s parser for a request offering tools with these parameter schemas (by tool name;
    qwen3_coder types its text arguments by them); None for a format not known ("" among them)."""
    if name == QWEN3_CODER:
        return Qwen3CoderParser(schemas)
    return PARSERS.get(name)


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
