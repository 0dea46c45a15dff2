"""What the OpenAI front's request parsers share: the 400 naming a parameter, and how a refused
value is shown in its message."""

from __future__ import annotations

from typing import Any

from services.common import errors


class BadParameter(errors.InvalidArgument):
    """A request parameter is missing, of the wrong type or out of range; `param` names it."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


def shown(value: Any) -> str:
    """A value in a message: its repr, cut to 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
