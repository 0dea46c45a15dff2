"""Server-sent events, line by line: the `data:` payloads of an OpenAI-style stream. Pure: no I/O."""

from __future__ import annotations

DONE = "[DONE]"


class SseDecoder:
    """Feed it lines (bytes, with or without their line ending); it returns each event's data once
    the blank line ending the event arrives. Multi-line data joins with newlines, as the spec says."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed_line(self, raw: bytes) -> str | None:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            return self._flush()
        if line.startswith(":"):  # a comment (keep-alive)
            return None
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value.removeprefix(" "))
        return None

    def close(self) -> str | None:
        """The last event, when the stream ended without its blank line."""
        return self._flush()

    def _flush(self) -> str | None:
        if not self._data:
            return None
        data = "\n".join(self._data)
        self._data = []
        return data
