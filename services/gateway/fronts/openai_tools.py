"""Tool calls on /v1/chat/completions, OpenAI's JSON side: `tools`, `tool_choice` and
`parallel_tool_calls` checked into GenerateRequest.tools (400 naming the field) and a tool choice
(tool_calls.py: the constraint, the output's split into content and `tool_calls`), and the
conversation's calls and results (assistant tool_calls, `tool` turns) as ChatMessage fields.
"""

from __future__ import annotations

import json
from typing import Any

from infermesh.v1 import gateway_pb2
from services.common.generate_input import MAX_TOOLS, TOOL_NAME
from services.gateway.fronts.openai_params import BadParameter, shown
from services.gateway.fronts.tool_calls import EMPTY_PARAMETERS, NONE, ChatTools, choose, constrain


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
        schemas[spec.name] = json.loads(spec.parameters) if spec.parameters else EMPTY_PARAMETERS
        generate.tools.append(spec)
    chosen = choose(choice, schemas, parallel is not False)
    constrain(generate, chosen, schemas, shown(choice))
    return chosen


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
