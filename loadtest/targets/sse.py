"""Server-sent events: the `data:` payloads of an OpenAI-style stream, from lines or raw chunks. Pure: no I/O."""

from __future__ import annotations

DONE = "[DONE]"


class SseDecoder:
    """Feed it lines (bytes, with or without their line ending); it returns each event's data once
    the blank line ending the event arrives. Multi-line data joins with newlines, as the spec says."""

    def __init__(self) -> None:
        self._data: list[str] = []
        self._partial = b""  # feed(): the start of a line whose end has not arrived

    def feed(self, chunk: bytes) -> list[str]:
        """Every event the chunk completes, from bytes as they came off the socket (a line, or a
        UTF-8 character, may be cut anywhere): one call per read instead of one per line."""
        lines = (self._partial + chunk).split(b"\n") if self._partial else chunk.split(b"\n")
        self._partial = lines.pop()
        events = []
        for line in lines:
            data = self.feed_line(line)
            if data is not None:
                events.append(data)
        return events

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
        if self._partial:
            self.feed_line(self._partial)
            self._partial = b""
        return self._flush()

    def _flush(self) -> str | None:
        if not self._data:
            return None
        data = "\n".join(self._data)
        self._data = []
        return data
