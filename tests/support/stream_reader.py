"""A thread reading one Generate stream, checking each chunk's index as it comes (the failover tests)."""

from __future__ import annotations

import threading

from infermesh.v1 import common_pb2


class StreamReader(threading.Thread):
    """Reads `call` (a started Generate stream) to its end; the test reads what it collected."""

    def __init__(self, call, prompt: str = "") -> None:
        super().__init__()
        self.prompt = prompt
        self.call = call
        self.text: list[str] = []
        self.num_tokens = 0
        self.finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            for response in self.call:
                chunk = response.chunk
                assert not chunk.token_ids or chunk.index == self.num_tokens, (chunk.index, self.num_tokens)
                self.num_tokens += len(chunk.token_ids)
                self.text.append(chunk.text)
                self.finish_reason = chunk.finish_reason or self.finish_reason
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
