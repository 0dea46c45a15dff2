"""Tool calls on /v1/chat/completions: `tools`, `tool_choice` and `parallel_tool_calls` checked into
GenerateRequest.tools (400 naming the field), the conversation's calls and results
(assistant tool_calls, `tool` turns) as ChatMessage fields, and each choice's output split into
content and `tool_calls`, streamed (OpenAI's deltas: index, id, type, function.name, then pieces
of function.arguments) or whole.

How a call is made depends on tool_choice:
- `required` and a named function are constrained decoding: sampling.structured gets a JSON schema
  built from the tools' parameter schemas (vLLM's shapes), so even a random model's output is a
  valid call. Named: the output is the arguments object of that function, streamed as its
  arguments as it comes. Required: a JSON array of {"name", "parameters"}, one item per call
  (exactly one with parallel_tool_calls false), read when the output ends.
- `auto`: the model writes calls in its own format, which the scheduler names on the first chunk
  (tool_call_parsers.py reads each); text that is not a call is ordinary content.
- `none`: the tools are rendered for the model, and its output is content.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from infermesh.v1 import common_pb2, gateway_pb2
from services.common.generate_input import MAX_TOOLS, TOOL_NAME, check_input
from services.gateway.fronts.openai_params import BadParameter, shown
from services.gateway.fronts.tool_call_parsers import PARSERS, ParsedCall, call_from_object

AUTO, NONE, REQUIRED, NAMED = "auto", "none", "required", "named"
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ChatTools:
    """The request's tool choice, once checked: `mode` AUTO | NONE | REQUIRED | NAMED."""

    mode: str
    name: str = ""  # NAMED: the function to call

    @property
    def constrained(self) -> bool:
        return self.mode in (REQUIRED, NAMED)


# -- requests ---------------------------------------------------------------------------


def parse_tools(body: dict, generate: gateway_pb2.GenerateRequest) -> ChatTools | None:
    """tools, tool_choice and parallel_tool_calls into `generate` (its tools; the schema of a
    constrained choice as sampling.structured); None when the request offers no tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadParameter("parallel_tool_calls", f"parallel_tool_calls must be a boolean, got {shown(parallel)}")
    if tools is None or tools == []:
        if choice not in (None, NONE):
            raise BadParameter("tool_choice", "tool_choice needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise BadParameter("tools", f"tools must be a list of up to {MAX_TOOLS} "
                                    "{\"type\": \"function\", \"function\": {...}} objects")
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        spec = _tool(tool, i)
        if spec.name in schemas:
            raise BadParameter(f"tools[{i}].function.name", f"tools[{i}].function.name {spec.name!r} "
                                                            "is offered twice")
        schemas[spec.name] = json.loads(spec.parameters) if spec.parameters else _EMPTY_PARAMETERS
        generate.tools.append(spec)
    chosen = _choice(choice, schemas)
    _constrain(generate, chosen, schemas, parallel is not False, shown(choice))
    return chosen


def grpc_tool_choice(request: gateway_pb2.GenerateRequest) -> ChatTools | None:
    """GenerateRequest.tool_choice ("", auto, none, required or a tool's name) checked against its
    tools (InvalidArgument) and applied as parse_tools applies OpenAI's (parallel calls allowed);
    None when the request offers no tools."""
    check_input(request.prompt, request.messages, request.tools)  # the tools' schemas parse
    choice = request.tool_choice
    if not request.tools:
        if choice not in ("", NONE):
            raise BadParameter("tool_choice", "tool_choice needs tools")
        return None
    schemas = {t.name: json.loads(t.parameters) if t.parameters else _EMPTY_PARAMETERS for t in request.tools}
    as_openai = (choice or None) if choice in ("", AUTO, NONE, REQUIRED) else {"type": "function",
                                                                             "function": {"name": choice}}
    chosen = _choice(as_openai, schemas)
    _constrain(request, chosen, schemas, True, shown(choice))
    return chosen


def _constrain(generate: gateway_pb2.GenerateRequest, chosen: ChatTools, schemas: dict[str, dict], parallel: bool,
               shown_choice: str) -> None:
    """required / named: the output held to the calls' JSON schema (sampling.structured)."""
    if not chosen.constrained:
        return
    if generate.sampling.HasField("structured"):
        raise BadParameter("tool_choice", f"tool_choice {shown_choice} constrains the output itself; "
                                          "it cannot be combined with response_format or guided_*")
    schema = schemas[chosen.name] if chosen.mode == NAMED else _calls_schema(schemas, parallel)
    generate.sampling.structured.json_schema = json.dumps(schema)


def _tool(tool: Any, i: int) -> gateway_pb2.Tool:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
        raise BadParameter(f"tools[{i}]", f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                                                "{\"name\": ..., \"parameters\": {...}}}")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise BadParameter(f"tools[{i}].function.name", f"tools[{i}].function.name must match "
                                                              f"[a-zA-Z0-9_-]{{1,64}}, got {shown(name)}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise BadParameter(f"tools[{i}].function.description",
                                 f"tools[{i}].function.description must be a string")
    parameters = function.get("parameters")
    if parameters is not None and not (isinstance(parameters, dict) and parameters.get("type", "object") == "object"):
        raise BadParameter(f"tools[{i}].function.parameters",
                                 f"tools[{i}].function.parameters must be a JSON schema of an object "
                                 f"({{\"type\": \"object\", \"properties\": {{...}}}}), got {shown(parameters)}")
    return gateway_pb2.Tool(name=name, description=description or "",
                            parameters=json.dumps(parameters) if parameters is not None else "")


def _choice(choice: Any, schemas: dict[str, dict]) -> ChatTools:
    if choice is None:
        return ChatTools(AUTO)
    if choice in (AUTO, NONE, REQUIRED):
        return ChatTools(choice)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise BadParameter("tool_choice", "tool_choice must be \"auto\", \"none\", \"required\" or "
                                                "{\"type\": \"function\", \"function\": {\"name\": ...}}, "
                                                f"got {shown(choice)}")
    if name not in schemas:
        raise BadParameter("tool_choice", f"tool_choice names {name!r}, which is not among the tools "
                                                f"({', '.join(schemas)})")
    return ChatTools(NAMED, name)


def _calls_schema(schemas: dict[str, dict], parallel: bool) -> dict:
    """`required`: an array of calls, each {"name": <one of the tools>, "parameters": <its schema>}."""
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, schema in schemas.items()]
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": calls}}


def add_turn_fields(message: dict, i: int, turn: gateway_pb2.ChatMessage) -> None:
    """An assistant's tool_calls and a tool turn's tool_call_id (and name) onto `turn`."""
    calls = message.get("tool_calls")
    if calls is not None and calls != []:
        if turn.role != "assistant" or not isinstance(calls, list):
            raise BadParameter(f"messages[{i}].tool_calls",
                                     f"messages[{i}].tool_calls must be a list, on an assistant turn")
        for j, call in enumerate(calls):
            turn.tool_calls.append(_turn_call(call, f"messages[{i}].tool_calls[{j}]"))
    if turn.role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise BadParameter(f"messages[{i}].tool_call_id",
                                     f"messages[{i}].tool_call_id is required on a tool turn (the call it answers)")
        turn.tool_call_id = call_id
        name = message.get("name")
        if isinstance(name, str):
            turn.name = name


def _turn_call(call: Any, where: str) -> gateway_pb2.ToolCall:
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(function, dict) or not isinstance(name, str) or not name:
        raise BadParameter(where, f"{where} must be {{\"id\": ..., \"type\": \"function\", \"function\": "
                                        "{\"name\": ..., \"arguments\": \"<JSON>\"}}")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        raise BadParameter(f"{where}.function.arguments", f"{where}.function.arguments must be JSON text")
    call_id = call.get("id")
    return gateway_pb2.ToolCall(id=call_id if isinstance(call_id, str) else "", name=name, arguments=arguments)


# -- responses --------------------------------------------------------------------------


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
        mode = self._tools.mode if self._tools is not None else NONE
        tool_parser = PARSERS.get(parser) if mode == AUTO else None
        if mode in (NONE, AUTO) and tool_parser is None:  # plain chat: every chunk passes, nothing is kept but it
            self._contents.append(text)
            return text, []
        self._text += text
        if mode == NAMED:
            return "", self._named_delta()
        if mode == REQUIRED:
            return self._whole(self._required_calls) if last else ("", [])
        assert tool_parser is not None
        if not last:
            return self._content(max(self._sent, tool_parser.content_end(self._text))), []
        parsed = tool_parser.parse(self._text)
        if not parsed.calls:
            return self._content(len(self._text)), []
        content = self._content(max(self._sent, len(parsed.content)))
        return content, self._add_calls(parsed.calls)

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
