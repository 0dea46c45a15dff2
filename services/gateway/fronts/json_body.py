"""Request bodies of the HTTP front (OpenAI /v1, KServe REST /v2): read, decoded, parsed as strict JSON.

aiohttp's own decompression is off (http_server.py), so `body` undoes Content-Encoding here: a
body that is not what its header says, or an encoding the gateway does not speak, is a ValueError
naming it (a 400), not a parser error logged with a traceback.

`json.loads` accepts an escaped lone UTF-16 surrogate ("\\ud800") and returns a str that cannot be
encoded as UTF-8, so it failed later, deep in protobuf, as a 500. It also recurses once per level
of nesting, so a body of a thousand `[` was a RecursionError. An integer of more than 4300 digits
(Python's int_max_str_digits) is a ValueError whose message tells the reader to call
sys.set_int_max_str_digits(). Here each is a ValueError naming the problem for the client, like any
other malformed body.
"""

from __future__ import annotations

import json
import sys
import zlib
from typing import Any

from aiohttp import web

# Far deeper than any request the fronts take (a chat message's content parts: 4 levels; a KServe
# tensor's nested data: one per dimension, plus 3), far below Python's recursion limit.
MAX_DEPTH = 64
# Content-Encoding -> zlib's wbits for it.
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
_ACCEPTED_ENCODINGS = "identity, gzip or deflate"


async def body(request: web.Request) -> bytes:
    """The request's body with its Content-Encoding undone. 413 past the app's client_max_size once
    decompressed; ValueError with a message for the client when it cannot be decoded."""
    encoding = ", ".join(request.headers.getall("Content-Encoding", [])).strip().lower()
    return decoded(await request.read(), encoding, request.client_max_size)


def decoded(data: bytes, encoding: str, max_bytes: int) -> bytes:
    """`data` as sent with Content-Encoding `encoding` ("" or "identity": as is), decompressed."""
    if encoding in ("", "identity"):
        return data
    wbits = _WBITS.get(encoding)
    if wbits is None:
        raise ValueError(f"Content-Encoding {encoding[:40]!r} is not supported: send the body as "
                         f"{_ACCEPTED_ENCODINGS}")
    out = bytearray()
    rest = data
    while rest:  # gzip allows several members one after another
        decompressor = zlib.decompressobj(wbits)
        try:
            out += decompressor.decompress(rest, max_bytes + 1 - len(out))
        except zlib.error:
            raise ValueError(f"the body is not valid {encoding}") from None
        if len(out) > max_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=max_bytes, actual_size=len(out))
        if not decompressor.eof:
            raise ValueError(f"the body is not valid {encoding}: it ends before its compressed stream does")
        rest = decompressor.unused_data
        if rest and wbits == zlib.MAX_WBITS:
            raise ValueError(f"the body is not valid {encoding}: bytes follow its compressed stream")
    return bytes(out)


def loads(data: str | bytes, charset: str | None = None) -> Any:
    """The parsed document; ValueError with a message for the client when it is not valid JSON text.
    charset: the Content-Type's; without one, JSON's own detection (UTF-8, or UTF-16/32)."""
    if charset is not None and isinstance(data, bytes):
        data = _text(data, charset)
    try:
        document = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise _too_deep() from None
    except ValueError:  # the one other: an integer past Python's int_max_str_digits
        raise ValueError(f"the request body holds a number of more than {sys.get_int_max_str_digits()} "
                         "digits") from None
    if _deeper_than(document, MAX_DEPTH, data):
        raise _too_deep()
    try:  # one C-level pass over every string, keys included
        json.dumps(document, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the request body holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff)") from None
    return document


def _text(data: bytes, charset: str) -> str:
    try:
        return data.decode(charset)
    except LookupError:
        raise ValueError(f"the Content-Type's charset {charset[:40]!r} is not a known text encoding "
                         "(send UTF-8)") from None
    except UnicodeDecodeError:
        raise ValueError(f"the request body is not valid {charset[:40]} text, as its Content-Type says") from None


def _too_deep() -> ValueError:
    return ValueError(f"the request body is nested too deeply (more than {MAX_DEPTH} levels of arrays and objects)")


def _deeper_than(document: Any, max_depth: int, text: str | bytes) -> bool:
    # Nesting needs brackets: a body with few of them (most) is not walked at all.
    num_opening = text.count("[") + text.count("{") if isinstance(text, str) else text.count(b"[") + text.count(b"{")
    if num_opening <= max_depth or not isinstance(document, list | dict):
        return False
    stack = [(document, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > max_depth:
            return True
        children = value.values() if isinstance(value, dict) else value
        stack.extend((child, depth + 1) for child in children if isinstance(child, list | dict))
    return False
