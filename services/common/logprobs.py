"""Log-probabilities a request asked for (SamplingParams.logprobs), as plain data: what the worker's
sampler computes for each sampled token, under log_softmax(logits / temperature), and the scheduler
carries to the sequence's stream (the codecs convert to and from protobuf)."""

from __future__ import annotations

from dataclasses import dataclass

# The most alternatives a request may ask for at each position (OpenAI's top_logprobs limit): the
# gateway refuses more, and the scheduler and the worker check again.
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
