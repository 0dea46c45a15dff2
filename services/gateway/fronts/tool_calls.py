"""Tool calls without a transport, for the OpenAI front (openai_tools.py reads its JSON) and the
gRPC Generate (GenerateRequest.tool_choice) alike: the tool choice, the JSON schema that holds a
constrained choice's output, and each choice's output split into content and calls.

How a call is made depends on the choice:
- `required` and a named function are constrained decoding: sampling.structured gets a JSON schema
  built from the tools' parameter schemas (vLLM's shapes), so even a random model's output is a
  valid call. Named: the output is the arguments object of that function, streamed as its
  arguments as it comes. Required: a JSON array of {"name", "parameters"}, one item per call
  (exactly one with parallel_tool_calls false), read when the output ends.
- `auto`: the model writes calls in its own format, which the scheduler names on the first chunk
  (tool_call_parsers.py reads each); text that is not a call is ordinary content. With
  parallel_tool_calls false only the first call is kept (vLLM drops the others too; generation is
  not stopped at the first call's end).
- `none`: the tools are rendered for the model, and its output is content.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from infermesh.v1 import common_pb2, gateway_pb2
from services.common.generate_input import check_input
from services.gateway.fronts.openai_params import BadParameter, shown
from services.gateway.fronts.tool_call_parsers import ParsedCall, call_from_object, parser_for

AUTO, NONE, REQUIRED, NAMED = "auto", "none", "required", "named"
EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a tool without parameters takes {}


@dataclass(frozen=True)
class ChatTools:
    """The request's tool choice, once checked: `mode` AUTO | NONE | REQUIRED | NAMED."""

    mode: str
    name: str = ""  # NAMED: the function to call
    # parallel_tool_calls: false allows one call (required: the schema's array holds one; auto: the
    # first call parsed is kept, the rest dropped, as vLLM does).
    parallel: bool = True
    # The tools' parameter schemas by name, which auto's parsers type text arguments by (qwen3_coder).
    # The tools offered, not the choice: left out of equality.
    schemas: Mapping[str, dict] = field(default_factory=dict, compare=False)

    @property
    def constrained(self) -> bool:
        return self.mode in (REQUIRED, NAMED)


def grpc_tool_choice(request: gateway_pb2.GenerateRequest) -> ChatTools | None:
    """GenerateRequest.tool_choice ("", auto, none, required or a tool's name) and
    parallel_tool_calls checked against its tools (InvalidArgument) and applied as parse_tools
    applies OpenAI's; None when the request offers no tools."""
    check_input(request.prompt, request.messages, request.tools, request.prompt_token_ids)  # the tools' schemas parse
    choice = request.tool_choice
    if not request.tools:
        if choice not in ("", NONE):
            raise BadParameter("tool_choice", "tool_choice needs tools")
        return None
    schemas = {t.name: json.loads(t.parameters) if t.parameters else EMPTY_PARAMETERS for t in request.tools}
    as_openai = (choice or None) if choice in ("", AUTO, NONE, REQUIRED) else {"type": "function",
                                                                             "function": {"name": choice}}
    parallel = not request.HasField("parallel_tool_calls") or request.parallel_tool_calls
    chosen = choose(as_openai, schemas, parallel)
    constrain(request, chosen, schemas, shown(choice))
    return chosen


def constrain(generate: gateway_pb2.GenerateRequest, chosen: ChatTools, schemas: dict[str, dict],
              shown_choice: str) -> None:
    """required / named: the output held to the calls' JSON schema (sampling.structured)."""
    if not chosen.constrained:
        return
    if generate.sampling.HasField("structured"):
        raise BadParameter("tool_choice", f"tool_choice {shown_choice} constrains the output itself; "
                                          "it cannot be combined with response_format or guided_*")
    schema = schemas[chosen.name] if chosen.mode == NAMED else _calls_schema(schemas, chosen.parallel)
    generate.sampling.structured.json_schema = json.dumps(schema)


def choose(choice: Any, schemas: dict[str, dict], parallel: bool = True) -> ChatTools:
    """OpenAI's tool_choice (None: auto) checked against the tools offered (their schemas by name)."""
    if choice is None:
        return ChatTools(AUTO, parallel=parallel, schemas=schemas)
    if choice in (AUTO, NONE, REQUIRED):
        return ChatTools(choice, parallel=parallel, schemas=schemas)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise BadParameter("tool_choice", "tool_choice must be \"auto\", \"none\", \"required\" or "
                                          "{\"type\": \"function\", \"function\": {\"name\": ...}}, "
                                          f"got {shown(choice)}")
    if name not in schemas:
        raise BadParameter("tool_choice", f"tool_choice names {name!r}, which is not among the tools "
                                          f"({', '.join(schemas)})")
    return ChatTools(NAMED, name, parallel, schemas)


def _calls_schema(schemas: dict[str, dict], parallel: bool) -> dict:
    """`required`: an array of calls, each {"name": <one of the tools>, "parameters": <its schema>}."""
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, schema in schemas.items()]
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": calls}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallSplitter:
    """One choice's output as content and tool calls, chunk after chunk (feed), or whole (feed
    once with last=True). `calls` holds the whole calls made so far, in OpenAI's message shape."""

    def __init__(self, tools: ChatTools | None, new_id: Callable[[], str] = new_call_id) -> None:
        self._tools = tools
        self._new_id = new_id
        self._text = ""  # what may still be, or hold, a call (kept only when calls are read)
        self._sent = 0  # of _text, streamed as content (auto) or as arguments (named)
        self.calls: list[dict] = []
        self._contents: list[str] = []

    @property
    def content(self) -> str:
        """The content sent so far."""
        return "".join(self._contents)

    def feed(self, text: str, last: bool, parser: str = "") -> tuple[str, list[dict]]:
        """This chunk's content and its tool_calls deltas. `parser`: the format the first chunk named."""
        tools = self._tools if self._tools is not None else ChatTools(NONE)
        tool_parser = parser_for(parser, tools.schemas) if tools.mode == AUTO else None
        if tools.mode in (NONE, AUTO) and tool_parser is None:  # plain chat: every chunk passes, nothing is kept but it
            self._contents.append(text)
            return text, []
        self._text += text
        if tools.mode == NAMED:
            return "", self._named_delta()
        if tools.mode == REQUIRED:
            return self._whole(self._required_calls) if last else ("", [])
        assert tool_parser is not None
        if not last:
            return self._content(max(self._sent, tool_parser.content_end(self._text))), []
        parsed = tool_parser.parse(self._text)
        if not parsed.calls:
            return self._content(len(self._text)), []
        content = self._content(max(self._sent, len(parsed.content)))
        return content, self._add_calls(parsed.calls if tools.parallel else parsed.calls[:1])

    def finish_reason(self, reason: str | None) -> str | None:
        """"tool_calls" for a reply that called and ended as the model chose (not cut by max_tokens)."""
        return "tool_calls" if reason == "stop" and self.calls else reason

    def message(self) -> dict:
        """The whole choice's `message` (after the last feed)."""
        content = self.content
        if not self.calls:
            return {"role": "assistant", "content": content}
        return {"role": "assistant", "content": content if content.strip() else None, "tool_calls": self.calls}

    def _content(self, end: int) -> str:
        piece, self._sent = self._text[self._sent:end], end
        self._contents.append(piece)
        return piece

    def _named_delta(self) -> list[dict]:
        assert self._tools is not None
        piece, self._sent = self._text[self._sent:], len(self._text)
        if not self.calls:
            return [self._add_call(self._tools.name, piece)]
        self.calls[0]["function"]["arguments"] += piece
        return [{"index": 0, "function": {"arguments": piece}}] if piece else []

    def _whole(self, read: Callable[[str], tuple[ParsedCall, ...]]) -> tuple[str, list[dict]]:
        calls = read(self._text)
        if not calls:  # cut short by max_tokens: what the model wrote, as content
            return self._content(len(self._text)), []
        self._sent = len(self._text)
        return "", self._add_calls(calls)

    @staticmethod
    def _required_calls(text: str) -> tuple[ParsedCall, ...]:
        try:
            items = json.loads(text)
        except ValueError:
            return ()
        calls = [call_from_object(item, "parameters") for item in items] if isinstance(items, list) else []
        return tuple(c for c in calls if c is not None) if all(calls) else ()

    def _add_calls(self, calls: tuple[ParsedCall, ...]) -> list[dict]:
        return [self._add_call(call.name, call.arguments) for call in calls]

    def _add_call(self, name: str, arguments: str) -> dict:
        """A new call, kept whole in `calls`; its first delta (index, id, type, name, arguments so far)."""
        call_id = self._new_id()
        self.calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        return {"index": len(self.calls) - 1, "id": call_id, "type": "function",
                "function": {"name": name, "arguments": arguments}}


class GrpcToolCalls:
    """The gRPC Generate's tool calls: one choice's, parsed as the OpenAI front parses them (the
    text itself goes out as the model wrote it), set on its last chunk."""

    def __init__(self, tools: ChatTools) -> None:
        self._splitter = ToolCallSplitter(tools)
        self._parser: str | None = None

    def add(self, chunk: gateway_pb2.GenerateResponse) -> None:
        if self._parser is None:
            self._parser = chunk.tool_call_parser
        last = chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        self._splitter.feed(chunk.text, last, self._parser)
        if last:
            chunk.tool_calls.extend(gateway_pb2.ToolCall(id=c["id"], name=c["function"]["name"],
                                                         arguments=c["function"]["arguments"])
                                    for c in self._splitter.calls)
