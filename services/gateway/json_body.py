"""Request bodies of the HTTP front (OpenAI /v1, KServe REST /v2) parsed as strict JSON.

`json.loads` accepts an escaped lone UTF-16 surrogate ("\\ud800") and returns a str that cannot be
encoded as UTF-8, so it failed later, deep in protobuf, as a 500. Here it is a ValueError naming the
problem, like any other malformed body.
"""

from __future__ import annotations

import json
from typing import Any


def loads(data: str | bytes) -> Any:
    """The parsed document; ValueError with a message for the client when it is not valid JSON text."""
    try:
        document = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"the request body is not valid JSON: {exc}") from None
    try:  # one C-level pass over every string, keys included
        json.dumps(document, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the request body holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff)") from None
    return document
