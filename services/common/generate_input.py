"""GenerateRequest's input, validated: a prompt or a conversation (messages), exactly one.

Gateway and scheduler both check it with this one function (as stream_options.py), so a request
the gateway forwards is never refused upstream with another message, and a direct caller of the
scheduler gets the answer a client of the gateway gets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from services.common import errors

# OpenAI's roles (developer is its newer name for system); tool turns are not supported.
CHAT_ROLES = ("system", "developer", "user", "assistant")


class ChatTurn(Protocol):
    """infermesh.v1.ChatMessage, or anything shaped like it."""

    @property
    def role(self) -> str: ...

    @property
    def content(self) -> str: ...


def check_input(prompt: str, messages: Sequence[ChatTurn]) -> None:
    """InvalidArgument unless exactly one of prompt and messages is set, and every role is known."""
    if prompt and messages:
        raise errors.InvalidArgument("set prompt or messages, not both")
    if not prompt and not messages:
        raise errors.InvalidArgument("prompt must not be empty")
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            shown = message.role if len(message.role) <= 40 else message.role[:37] + "..."
            raise errors.InvalidArgument(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {shown!r}")
