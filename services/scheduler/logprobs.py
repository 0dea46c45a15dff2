"""Log-probabilities a request asked for (SamplingParams.logprobs): what a worker reports for each
sampled token, carried to the sequence's stream. Plain data, no protobuf (attach_codec converts)."""

from __future__ import annotations

from dataclasses import dataclass

# The most alternatives a request may ask for at each position (OpenAI's top_logprobs limit; the
# worker's sampling.MAX_TOP_LOGPROBS is the same number, checked again there).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float  # natural log, <= 0


@dataclass(frozen=True)
class PositionLogprobs:
    """At one output position: the sampled token's logprob and the most likely tokens, most likely first."""

    token: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()
