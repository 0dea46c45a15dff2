"""What of a sequence's generated tokens may be streamed to the client yet.

Stop strings are never returned, so text that could be the start of one is held
back until the next tokens show it is not; bytes of an incomplete UTF-8
character are held back until it completes. Token ids travel in lockstep with
their text: a chunk's text is exactly the decoding of its token ids' bytes
(continuing the bytes held back before), so a client counting tokens by
`index` and reading text never sees either skipped or repeated. One exception:
a stop string can begin inside a token (tokens of HF tokenizers are several
bytes), so the chunk a stop string ends carries every token with text before
the stop, the one the stop begins in included, and the text up to the stop
exactly (as vLLM and OpenAI cut it).

The stream belongs to the sequence, not to a worker: preemption or failover
recomputes KV but leaves what was generated and what was streamed untouched.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass

from services.scheduler.tokenizer import Tokenizer


# Not frozen: one is built per token (why: step_plan.SequenceStep).
@dataclass(slots=True)
class StreamChunk:
    # Newly streamable token ids, in order (may be empty with text, or text empty with ids).
    token_ids: tuple[int, ...]
    text: str
    # Position in the streamed output of token_ids[0].
    index: int

    def __bool__(self) -> bool:
        return bool(self.token_ids or self.text)


class OutputStream:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), min_tokens: int = 0,
                 include_stop: bool = False) -> None:
        """`min_tokens` (vLLM's): no stop string is looked for until more tokens than that were
        appended; then only those ending in the new token's bytes (as vLLM's detokenizer looks).
        `include_stop` (vLLM's include_stop_str_in_output): the text ends after the matched stop string."""
        self._tokenizer = tokenizer
        self._min_tokens = min_tokens
        self._include_stop = include_stop
        self._stops = tuple(s.encode("utf-8") for s in stop if s)
        self._max_stop_len_bytes = max((len(s) for s in self._stops), default=0)
        self._token_ids: list[int] = []
        # _byte_ends[i]: end offset in _bytes of token i's bytes.
        self._byte_ends: list[int] = []
        self._bytes = bytearray()
        self._num_emitted_tokens = 0
        self._num_emitted_bytes = 0
        # Offset where the first matched stop string begins; None while none matched. Where the text ends
        # then: there, or after the stop string with include_stop.
        self._stop_at_byte: int | None = None
        self._text_end_byte = 0
        self._matched_stop = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    @property
    def stopped(self) -> bool:
        """A stop string matched: append nothing more."""
        return self._stop_at_byte is not None

    @property
    def matched_stop(self) -> str:
        """The stop string that matched ("": none)."""
        return self._matched_stop

    @property
    def num_emitted_tokens(self) -> int:
        return self._num_emitted_tokens

    def append(self, token_id: int) -> bool:
        """Adds a generated token; True when the text now contains a stop string."""
        if self._stop_at_byte is not None:
            raise ValueError("cannot append after a stop string matched")
        old_end = len(self._bytes)
        self._bytes += self._tokenizer.token_bytes(token_id)
        self._token_ids.append(token_id)
        self._byte_ends.append(len(self._bytes))
        if not self._stops or len(self._token_ids) <= self._min_tokens:  # no stops: no search at all
            return False
        # Only a match ending in the new bytes: one that ended before was found then, or fell in
        # min_tokens' tokens, where it does not count.
        matches = [(i, i + len(s), s) for i, s in ((self._bytes.find(s, max(0, old_end - len(s) + 1)), s)
                                                   for s in self._stops) if i >= 0]
        if matches:
            self._stop_at_byte, stop_end, stop = min(matches)
            self._text_end_byte = stop_end if self._include_stop else self._stop_at_byte
            self._matched_stop = stop.decode("utf-8")
        return self.stopped

    def replay(self, token_ids: Sequence[int]) -> None:
        """Takes tokens the client already received (a continuation) as appended and streamed.

        Afterwards the state is what the unbroken stream had once it sent them: the
        bytes of a character they leave incomplete sit in the decoder, and the stop
        search sees their bytes, so a held-back prefix of a stop string that the
        next tokens complete still matches. Nothing they hold back is streamed again:
        the client has it. ValueError when a stop string matched inside them (the
        unbroken stream would have ended before sending them).
        """
        if self._token_ids:
            raise ValueError("replay() only on a fresh stream")
        for i, token_id in enumerate(token_ids):
            if self.append(token_id):
                raise ValueError(f"a stop string ends at token {i} of the tokens already delivered")
        self._decoder.decode(bytes(self._bytes), False)  # keeps an incomplete character's bytes, as streaming did
        self._num_emitted_tokens = len(self._token_ids)
        self._num_emitted_bytes = len(self._bytes)

    def take(self, *, final: bool) -> StreamChunk:
        """Everything streamable now and not streamed before. `final`: the sequence ended."""
        start = self._num_emitted_tokens
        num_tokens = len(self._token_ids)
        byte_ends = self._byte_ends
        end = start
        if self._stop_at_byte is not None:  # every token that begins before the text's end; text up to it
            end_byte = self._text_end_byte
            while end < num_tokens and (byte_ends[end - 1] if end > 0 else 0) < end_byte:
                end += 1
            final = True
        else:
            if self._stops and not final:
                limit = len(self._bytes) - self._stop_prefix_suffix_len(len(self._bytes))
            else:  # no stop string to hold text back for: everything appended is streamable
                limit = len(self._bytes)
            while end < num_tokens and byte_ends[end] <= limit:
                end += 1
            end_byte = byte_ends[end - 1] if end > 0 else 0
        token_ids = tuple(self._token_ids[start:end])
        # The decoder copies what it keeps of an incomplete character, so a bytearray slice will do.
        text = self._decoder.decode(self._bytes[self._num_emitted_bytes : end_byte], final)
        chunk = StreamChunk(token_ids, text, start)
        self._num_emitted_tokens = end
        self._num_emitted_bytes = end_byte
        return chunk

    def _stop_prefix_suffix_len(self, limit: int) -> int:
        """Length of the longest tail of _bytes[:limit] that a stop string starts with."""
        for length in range(min(self._max_stop_len_bytes - 1, limit), 0, -1):
            tail = bytes(self._bytes[limit - length : limit])
            if any(s.startswith(tail) for s in self._stops):
                return length
        return 0
