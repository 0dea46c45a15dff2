"""The prompt in an OpenAI answer: completions' `echo` (the prompt before the completion, in `text`
and, with `logprobs`, in the logprobs object) and vLLM's `prompt_logprobs` (each prompt token's
logprob and the k most likely there). Both come from GenerateResponse.prompt_logprobs, which the
stream's first chunk carries (sampling.prompt_logprobs asks for them).

`echo` with `max_tokens: 0` returns the prompt alone (evals score a text this way): upstream it
generates one token (a sequence samples at least one), which is dropped and not counted in
`usage.completion_tokens`, as vLLM does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from infermesh.v1 import common_pb2
from services.common.logprobs import MAX_TOP_LOGPROBS
from services.gateway.fronts.openai_params import (
    WHOLE_VOCABULARY,
    BadParameter,
    boolean,
    is_int,
    shown,
    whole_vocabulary_refused,
)


@dataclass(frozen=True)
class PromptOptions:
    """What a request asked of its prompt."""

    echo: bool = False
    # echo with max_tokens 0: the prompt alone, the one token generated upstream dropped.
    echo_only: bool = False
    # vLLM's prompt_logprobs: return them with this many alternatives (None: not asked).
    prompt_logprobs: int | None = None

    def upstream(self, top_logprobs: int | None) -> int | None:
        """sampling.prompt_logprobs: the most alternatives any view needs. `top_logprobs`: completions'
        `logprobs: k` (None: not asked), which echo extends over the prompt."""
        wanted = [k for k in (self.prompt_logprobs, top_logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None


def prompt_options(body: dict, completion: bool) -> PromptOptions:
    """echo (completions only; max_tokens 0 with it) and vLLM's prompt_logprobs, checked."""
    echo = boolean(body, "echo", False)
    if echo and not completion:
        raise BadParameter("echo", "echo is a completions parameter (/v1/completions), not a chat one")
    max_tokens = body.get("max_tokens")
    echo_only = echo and is_int(max_tokens) and max_tokens == 0
    value = body.get("prompt_logprobs")
    if value == WHOLE_VOCABULARY and is_int(value):
        raise whole_vocabulary_refused("prompt_logprobs", "prompt")
    if value is not None and (not is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS):
        raise BadParameter("prompt_logprobs", f"prompt_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                                              f"got {shown(value)}")
    return PromptOptions(echo, echo_only, value)


def vllm_prompt_logprobs(positions: Sequence[common_pb2.PositionLogprobs], k: int) -> list[dict | None]:
    """vLLM's shape: None for the first prompt token, then per position a map from token id (as text) to
    {logprob, rank, decoded_token} holding the prompt token and the k most likely (rank: 1 for the most
    likely; null for a prompt token outside the k, whose rank the worker does not report)."""
    entries: list[dict | None] = []
    for position in positions:
        if math.isnan(position.token.logprob):
            entries.append(None)
            continue
        entry = {str(t.token_id): _vllm_logprob(t, rank) for rank, t in enumerate(position.top[:k], start=1)}
        entry.setdefault(str(position.token.token_id), _vllm_logprob(position.token, None))
        entries.append(entry)
    return entries


def _vllm_logprob(token: common_pb2.TokenLogprob, rank: int | None) -> dict:
    return {"logprob": token.logprob, "rank": rank,
            "decoded_token": token.token_bytes.decode("utf-8", errors="replace")}
