"""Whether a continuation (the output tokens a client already received) can resume a stream.

A gateway whose stream broke on another scheduler resumes it here with every
token the client received (ScheduleGenerateRequest.continuation). The sequence
starts with those tokens as its output: prompt + tokens are prefilled as one
recompute (the same path as a sequence preempted after generating), sampling
continues at position len(tokens), and the output stream replays them without
sending anything (OutputStream.replay). So the resumed stream sends exactly what
the unbroken one would have sent after them.

Tokens that no unbroken stream could have delivered are refused with
INVALID_ARGUMENT: an id outside the vocabulary; an end-of-sequence id (eos or one
of the model's stop ids: never streamed unless ignore_eos); a stop string inside them (it is never
streamed either: its stream ended before it); as many tokens as max_tokens or
more (that stream is complete).
A continuation with temperature > 0 needs the seed the first attempt sampled
with, or the rest would be drawn from another distribution than its beginning.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.errors import InvalidArgument
from services.scheduler.sequence import SamplingParams
from services.scheduler.tokenizer import Tokenizer


def check_continuation(token_ids: Sequence[int], sampling: SamplingParams, tokenizer: Tokenizer) -> None:
    """InvalidArgument naming the first reason `token_ids` cannot resume a stream; None when they can.
    A stop string inside them is found by the replay itself (OutputStream.replay); prompt + tokens
    beyond max_seq_len by the request's own check, prompt + max_tokens <= max_seq_len, since the
    tokens are fewer than max_tokens."""
    num_tokens = len(token_ids)
    if num_tokens >= sampling.max_tokens:
        raise InvalidArgument(
            f"continuation has {num_tokens} tokens but max_tokens is {sampling.max_tokens}: "
            "that stream is already complete"
        )
    if sampling.temperature > 0 and sampling.seed is None:
        raise InvalidArgument(
            "a continuation with temperature > 0 needs sampling.seed (the seed its first tokens were sampled with)"
        )
    vocab_size = tokenizer.vocab_size
    eos_ends_stream = not sampling.ignore_eos
    for i, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidArgument(f"continuation.token_ids[{i}] = {token_id} is outside the vocabulary [0, {vocab_size})")
        if eos_ends_stream and token_id in tokenizer.end_token_ids:
            raise InvalidArgument(
                f"continuation.token_ids[{i}] is the end-of-sequence id {token_id}, which a stream never "
                "delivers (unless ignore_eos): a stream that ended is not resumed"
            )
        if token_id in sampling.stop_token_ids:
            raise InvalidArgument(f"continuation.token_ids[{i}] is {token_id}, one of sampling.stop_token_ids: "
                                  "a stream that ended is not resumed")
