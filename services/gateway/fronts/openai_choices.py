"""n > 1 and best_of: one GenerateRequest per choice, their chunks merged into one stream, for
the OpenAI front (n, best_of) and the gRPC Generate (GenerateRequest.n, best_of) alike.

The first choice runs alone until its first chunk: by then its prompt's full KV blocks are in the
scheduler's prefix cache, so the other choices, sent after it, reuse them instead of computing the
prompt again (cache-aware routing sends them to the same scheduler). The first choice's admission
judges the request's TTFT target; the others are started as further choices (`start(r, True, ...)`),
which admission does not judge on it again: a request whose first choice streamed is not refused
part-way for one of its own choices, as vLLM runs a request's n sequences as one. The choices (and a
completion's batched prompts) take turns as the parts of one request (turns.py): one shed at admission
while others of its request run asks again once one of them ended. Choice i samples with the
request's seed + i, so a seeded request is reproducible choice by choice; an unseeded one gets a
seed per choice at admission, as any request does. No transport here: the HTTP front drives it.
"""

from __future__ import annotations

import contextlib
import math
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field

from infermesh.v1 import common_pb2, gateway_pb2
from services.common import errors
from services.gateway.fronts.reasoning import NO_REASONING, ReasoningFormat
from services.gateway.fronts.turns import Part, Start, in_turns

SEED_MODULUS = 2**63  # seeds are below it (the gateway's own draws and the OpenAI front's bound)
# Most choices one request generates (n, best_of): each is a sequence of its own upstream, admitted,
# counted against the tenant's quotas and the gateway's concurrency like a request.
MAX_CHOICES = 16


def choice_requests(request: gateway_pb2.GenerateRequest, num_choices: int) -> list[gateway_pb2.GenerateRequest]:
    """`request` for one choice; copies with request ids `<id>-<i>` and seeds seed + i for more."""
    if num_choices == 1:
        return [request]
    requests = []
    for i in range(num_choices):
        choice = gateway_pb2.GenerateRequest()
        choice.CopyFrom(request)
        choice.request_id = f"{request.request_id}-{i}"
        choice.n = choice.best_of = 0  # each is one sequence upstream
        if request.sampling.HasField("seed"):
            choice.sampling.seed = (request.sampling.seed + i) % SEED_MODULUS
        if i:
            # The prompt is the same: the first choice's logprobs of it serve them all, and the
            # others reuse its blocks from the prefix cache (a request asking reads none).
            choice.sampling.ClearField("prompt_logprobs")
        requests.append(choice)
    return requests


@dataclass(frozen=True)
class GrpcChoices:
    """GenerateRequest.n and best_of, checked: a request per candidate, and how many to return."""

    requests: list[gateway_pb2.GenerateRequest]
    n: int  # choices returned: every candidate, or the n best when there are more
    logprobs: bool  # whether the caller asked for logprobs (best_of asks the workers, to rank by)

    @property
    def ranked(self) -> bool:
        return len(self.requests) > self.n


def grpc_choices(request: gateway_pb2.GenerateRequest) -> GrpcChoices:
    """GenerateRequest.n and best_of checked (InvalidArgument) and expanded: one request per candidate."""
    if request.n > MAX_CHOICES:
        raise errors.InvalidArgument(f"n must be in 0..{MAX_CHOICES}, got {request.n}")
    n = max(request.n, 1)
    best_of = request.best_of or n
    if not n <= best_of <= MAX_CHOICES:
        raise errors.InvalidArgument(f"best_of must be 0 or in n..{MAX_CHOICES} ({n}..{MAX_CHOICES}), "
                                     f"got {request.best_of}")
    logprobs = request.sampling.logprobs
    if best_of > n:
        request.sampling.logprobs = True  # the ranking's input
    if best_of == 1:
        return GrpcChoices([request], 1, logprobs)
    request.request_id = request.request_id or uuid.uuid4().hex
    return GrpcChoices(choice_requests(request, best_of), n, logprobs)


async def ranked(choices: AsyncIterator[tuple[int, gateway_pb2.GenerateResponse]], plan: GrpcChoices
                 ) -> AsyncGenerator[tuple[int, gateway_pb2.GenerateResponse], None]:
    """best_of > n on gRPC: every candidate gathered to its end, then the n best's chunks as (rank,
    chunk), best first; the first chunk carries the prompt's logprobs (if asked), the last counts the
    unreturned candidates' tokens."""
    results = [ChoiceResult() for _ in plan.requests]
    async for index, chunk in choices:
        results[index].add(chunk)
    if not all(result.finished for result in results):
        raise errors.Internal("a candidate's stream ended without its last chunk")
    returned = best(results, plan.n)
    out = [(rank, chunk) for rank, result in enumerate(returned) for chunk in result.chunks]
    prompt = list(results[0].chunks[0].prompt_logprobs)  # only the first candidate asked for the prompt's
    for _, chunk in out:
        del chunk.prompt_logprobs[:]
        if not plan.logprobs:
            del chunk.logprobs[:]
    out[0][1].prompt_logprobs.extend(prompt)  # on the stream's first chunk, whichever candidate it is
    out[-1][1].unreturned_completion_tokens = _completion_tokens(results) - _completion_tokens(returned)
    for item in out:
        yield item


async def merged(start: Start, requests: Sequence[gateway_pb2.GenerateRequest]
                 ) -> AsyncGenerator[tuple[int, gateway_pb2.GenerateResponse], None]:
    """(choice index, chunk) of every choice, each choice's in order, the choices taking turns
    (turns.py). The first choice's first chunk comes before any other choice starts (its refusal is
    raised before anything is sent). An error of any choice is raised here, and closing this iterator
    closes every choice's stream."""
    async with contextlib.aclosing(merged_groups(start, [requests])) as chunks:
        async for _, index, chunk in chunks:
            yield index, chunk


async def merged_groups(start: Start, groups: Sequence[Sequence[gateway_pb2.GenerateRequest]]
                        ) -> AsyncGenerator[tuple[int, int, gateway_pb2.GenerateResponse], None]:
    """(group, choice index, chunk): a completion's batched prompts (groups), each prompt's choices, all
    taking turns as the parts of one request (turns.py): the first prompt's first choice is admitted
    before any other starts, and each prompt's later choices start after its first choice's first chunk.
    An error of any is raised here; closing this closes them all."""
    parts: list[Part] = []
    where: list[tuple[int, int]] = []
    for group, requests in enumerate(groups):
        first = len(parts)
        for index, request in enumerate(requests):
            parts.append(Part(request, after=first if index else None))
            where.append((group, index))
    async with contextlib.aclosing(in_turns(start, parts)) as chunks:
        async for part, chunk in chunks:
            yield (*where[part], chunk)


@dataclass
class ChoiceResult:
    """One choice's whole output, gathered from its chunks."""

    texts: list[str] = field(default_factory=list)
    logprobs: list[common_pb2.PositionLogprobs] = field(default_factory=list)
    last: gateway_pb2.GenerateResponse | None = None
    tool_call_parser: str = ""  # the format the first chunk named (a request offering tools)
    reasoning: ReasoningFormat = NO_REASONING  # how the first chunk said the model reasons
    # The prompt's, from the first chunk (the first choice's only: sampling.prompt_logprobs).
    prompt_logprobs: list[common_pb2.PositionLogprobs] = field(default_factory=list)
    chunks: list[gateway_pb2.GenerateResponse] = field(default_factory=list)

    def add(self, chunk: gateway_pb2.GenerateResponse) -> None:
        if self.last is None:
            self.tool_call_parser = chunk.tool_call_parser
            self.reasoning = ReasoningFormat.of_chunk(chunk)
        self.chunks.append(chunk)
        self.texts.append(chunk.text)
        self.logprobs.extend(chunk.logprobs)
        self.prompt_logprobs.extend(chunk.prompt_logprobs)
        self.last = chunk

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def token_ids(self) -> list[int]:
        """vLLM's return_token_ids: every token generated, the end-of-sequence or stop token that
        ended it included (counted, never streamed as text)."""
        return [t for chunk in self.chunks for t in chunk_token_ids(chunk)]

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self.chunks[0].prompt_token_ids) if self.chunks else []

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED

    def mean_logprob(self) -> float | None:
        """best_of's ranking: the mean logprob per token (OpenAI: "the highest log probability per
        token"), over the tokens that have one (NaN: a worker that sent none, one predating logprobs
        during a rollout). None, undefined, for a choice with none: one that ended at once (its end token
        is counted in usage but never streamed, so its logprob never reaches the gateway; vLLM's v0
        best_of summed it in, which ranked such a choice by how likely the end was)."""
        values = [p.token.logprob for p in self.logprobs if not math.isnan(p.token.logprob)]
        return sum(values) / len(values) if values else None


def chunk_token_ids(chunk: gateway_pb2.GenerateResponse) -> list[int]:
    """A chunk's generated tokens as vLLM's token_ids lists them: the end token on the last."""
    ids = list(chunk.token_ids)
    if chunk.HasField("end_token_id"):
        ids.append(chunk.end_token_id)
    return ids


def _completion_tokens(results: Sequence[ChoiceResult]) -> int:
    return sum(r.last.usage.completion_tokens for r in results if r.last is not None)


def best(results: Sequence[ChoiceResult], n: int) -> list[ChoiceResult]:
    """The n best of `results` by mean logprob per token, best first (ties: the lower choice index);
    those without a mean (no token with a logprob: ended at once) after every one with a mean, by index."""
    return [results[i] for i in sorted(range(len(results)), key=lambda i: _rank_key(results[i], i))[:n]]


def _rank_key(result: ChoiceResult, index: int) -> tuple[bool, float, int]:
    mean = result.mean_logprob()
    return (mean is None, 0.0 if mean is None else -mean, index)
