"""GenerateRequest.stream, validated: how a client wants its tokens grouped into chunks.

Gateway and scheduler both check it with this one function, so a request the
gateway forwards is never refused upstream with a different message, and a
direct caller of the scheduler gets the same answer as a client of the gateway.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common import errors

# Bounds on the public fields. Past them a client gets INVALID_ARGUMENT rather than a stream that
# looks hung: 1024 tokens is a few KiB per chunk (far under any message limit) and 5 s between
# chunks is already longer than any interactive client would wait for text it could have shown.
MAX_TOKENS_PER_CHUNK = 1024
MAX_INTERVAL_MS = 5000


@dataclass(frozen=True)
class StreamOptions:
    # 0 = no count limit; 1 = a chunk per token (today's behaviour).
    max_tokens_per_chunk: int = 0
    # 0 = no timer.
    interval_ms: int = 0

    @property
    def coalesces(self) -> bool:
        """Whether any chunk can hold more than one engine step's tokens. With max_tokens_per_chunk=1
        every token is a full chunk, so the interval never holds anything back."""
        if self.max_tokens_per_chunk == 1:
            return False
        return self.max_tokens_per_chunk > 1 or self.interval_ms > 0


def stream_options(max_tokens_per_chunk: int, interval_ms: int) -> StreamOptions:
    """The request's options, or InvalidArgument naming the field, its value and its range."""
    if max_tokens_per_chunk > MAX_TOKENS_PER_CHUNK:
        raise errors.InvalidArgument(
            f"stream.max_tokens_per_chunk must be in [0, {MAX_TOKENS_PER_CHUNK}], got {max_tokens_per_chunk}")
    if interval_ms > MAX_INTERVAL_MS:
        raise errors.InvalidArgument(f"stream.interval_ms must be in [0, {MAX_INTERVAL_MS}], got {interval_ms}")
    return StreamOptions(max_tokens_per_chunk, interval_ms)
