"""GenerateRequest's input, validated: a prompt (text or token ids) or a conversation (messages),
exactly one, and the tools a conversation may call.

Gateway and scheduler both check it with this one function (as stream_options.py), so a request
the gateway forwards is never refused upstream with another message, and a direct caller of the
scheduler gets the answer a client of the gateway gets.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Protocol

from services.common import errors

# OpenAI's roles (developer is its newer name for system; tool answers a call).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI's bounds on a function's name and on how many tools one request offers.
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_TOOLS = 128


class ToolCallTurn(Protocol):
    """infermesh.v1.ToolCall, or anything shaped like it."""

    @property
    def name(self) -> str: ...


class ChatTurn(Protocol):
    """infermesh.v1.ChatMessage, or anything shaped like it."""

    @property
    def role(self) -> str: ...

    @property
    def content(self) -> str: ...

    @property
    def tool_calls(self) -> Sequence[ToolCallTurn]: ...


class ToolSpec(Protocol):
    """infermesh.v1.Tool, or anything shaped like it."""

    @property
    def name(self) -> str: ...

    @property
    def parameters(self) -> str: ...


def check_input(prompt: str, messages: Sequence[ChatTurn], tools: Sequence[ToolSpec] = (),
                token_ids: Sequence[int] = ()) -> None:
    """InvalidArgument unless exactly one of prompt, token_ids (prompt_token_ids) and messages is set,
    every role is known, only assistant turns carry calls, and the tools (with messages only) are well
    formed. Token ids are checked against the model's vocabulary where it is known (the scheduler)."""
    if prompt and messages:
        raise errors.InvalidArgument("set prompt or messages, not both")
    if token_ids and (prompt or messages):
        raise errors.InvalidArgument(f"set prompt_token_ids or {'prompt' if prompt else 'messages'}, not both")
    if not prompt and not messages and not token_ids:
        raise errors.InvalidArgument("prompt must not be empty")
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise errors.InvalidArgument(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                                         f"got {_shown(message.role)}")
        if message.tool_calls and message.role != "assistant":
            raise errors.InvalidArgument(f"messages[{i}].tool_calls: only assistant turns carry tool calls")
        for j, call in enumerate(message.tool_calls):
            if not call.name:
                raise errors.InvalidArgument(f"messages[{i}].tool_calls[{j}].name must not be empty")
    if tools and not messages:
        raise errors.InvalidArgument("tools need messages (a conversation), not a prompt")
    _check_tools(tools)


def _check_tools(tools: Sequence[ToolSpec]) -> None:
    if len(tools) > MAX_TOOLS:
        raise errors.InvalidArgument(f"tools: at most {MAX_TOOLS} are allowed, got {len(tools)}")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        if not TOOL_NAME.fullmatch(tool.name):
            raise errors.InvalidArgument(f"tools[{i}].name must match [a-zA-Z0-9_-]{{1,64}}, got {_shown(tool.name)}")
        if tool.name in names:
            raise errors.InvalidArgument(f"tools[{i}].name {tool.name!r} is offered twice")
        names.add(tool.name)
        if tool.parameters and not isinstance(_json_or_none(tool.parameters), dict):
            raise errors.InvalidArgument(f"tools[{i}].parameters must be a JSON schema (an object, as JSON text)")


def _json_or_none(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _shown(value: str) -> str:
    return repr(value if len(value) <= 40 else value[:37] + "...")
