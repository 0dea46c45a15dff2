"""vLLM's bad_words: the words tokenized once at admission, and the ids each sampling step bans.

A word becomes token sequences (vLLM's rule): its text with leading spaces dropped, and that text after
one space when it tokenizes to as many tokens with another first one (the word inside a sentence),
neither with special tokens. Only a sequence's last token is ever banned: a one-token word's at every
sampling step, a longer word's at the step right after the output's tokens end with its other tokens.
The output only, never the prompt (vLLM matches its output tokens), and a continuation's delivered
tokens are output.

A ban list depends on the output's last tokens, so a sequence with a longer word is never decoded from
a sample still in flight (step_scheduler.py leaves it out of a step planned ahead until that sample is
back); one-token words ban the same ids at every step and need nothing of the output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.common.sampling_bounds import MAX_BAD_WORD_BYTES, MAX_BAD_WORDS

# MAX_BAD_WORDS and MAX_BAD_WORD_BYTES: every sampling step compares the output's end with each longer
# word's tokens, so the list is bounded (vLLM sets no bound; 128 covers a block list).


class BadWordRefused(ValueError):
    """A word no token sequence can be made of, or one past the bounds; the message names it."""


@dataclass(frozen=True)
class BadWords:
    # The tokens of one-token words: banned at every sampling step.
    always: tuple[int, ...]
    # Longer words as (their tokens but the last, the last): the last is banned right after the first.
    after: tuple[tuple[tuple[int, ...], int], ...] = ()

    @property
    def reads_output(self) -> bool:
        """Whether a step's bans depend on the output so far (a word of several tokens)."""
        return bool(self.after)

    def banned(self, output_token_ids: Sequence[int]) -> tuple[int, ...]:
        """The ids the next sample must not be, after `output_token_ids` (the whole output so far)."""
        if not self.after:
            return self.always
        bans = list(self.always)
        num_output = len(output_token_ids)
        for head, last in self.after:
            num_head = len(head)
            # The last token first: most steps fail there without slicing the output.
            if (num_head <= num_output and output_token_ids[-1] == head[-1]
                    and tuple(output_token_ids[num_output - num_head:]) == head):
                bans.append(last)
        return tuple(bans)


def tokenize_bad_words(words: Sequence[str], encode: Callable[[str], Sequence[int]], vocab_size: int,
                       field: str = "bad_words") -> BadWords | None:
    """`words` as BadWords (None when there are none); `encode(text)` gives text's ids without special
    tokens. BadWordRefused, its message naming `field`, for too many or too long words, a blank one, or
    one tokenized past the vocabulary."""
    if len(words) > MAX_BAD_WORDS:
        raise BadWordRefused(f"{field} holds {len(words)} words; at most {MAX_BAD_WORDS} are allowed")
    sequences: list[tuple[int, ...]] = []
    for index, word in enumerate(words):
        text = word.lstrip()
        if not text or len(word.encode("utf-8")) > MAX_BAD_WORD_BYTES:
            raise BadWordRefused(f"{field}[{index}] must be 1-{MAX_BAD_WORD_BYTES} bytes of UTF-8 with a non-space "
                                 f"character, got {len(word.encode('utf-8'))} bytes")
        bare = tuple(encode(text))
        if not bare:
            raise BadWordRefused(f"{field}[{index}] tokenizes to no token")
        sequences.append(bare)
        spaced = tuple(encode(" " + text))
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            sequences.append(spaced)
    if not sequences:
        return None
    past = [t for s in sequences for t in s if not 0 <= t < vocab_size]
    if past:
        raise BadWordRefused(f"{field} tokenize to ids {past[:5]} outside the model's vocabulary (vocab_size {vocab_size})")
    always = tuple(dict.fromkeys(s[0] for s in sequences if len(s) == 1))
    after = tuple(dict.fromkeys((s[:-1], s[-1]) for s in sequences if len(s) > 1))
    return BadWords(always, after)
