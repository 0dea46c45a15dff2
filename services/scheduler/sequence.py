"""One generate request as the step scheduler tracks it.

The invariant of continuous batching, stated once: there is no prefill phase and
no decode phase, only `num_computed_tokens` catching up with `num_tokens`. A
prompt chunk, a decode step and a recompute after preemption all compute
`all_token_ids[num_computed_tokens : num_computed_tokens + n]`; a step samples a
next token only when it reaches the end of the sequence.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.common.grammar_after_reasoning import GrammarAfterReasoning
from services.common.logprobs import MAX_TOP_LOGPROBS, PositionLogprobs
from services.scheduler.bad_words import BadWords
from services.scheduler.fair_queue import Priority, TenantContext
from services.scheduler.output_stream import OutputStream


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, never scheduled
    RUNNING = "running"  # holds KV blocks; scheduled every step while budget allows
    PREEMPTED = "preempted"  # blocks freed; will recompute prompt + generated tokens
    FINISHED = "finished"  # stopped or aborted; holds nothing


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_tokens or max_seq_len reached
    EOS = "eos"  # the model emitted end-of-sequence
    STOP = "stop"  # a stop string matched


class AbortReason(enum.Enum):
    CANCELLED = "cancelled"  # the client went away
    DEADLINE_EXCEEDED = "deadline_exceeded"
    FAILED = "failed"  # the worker reported an error for this sequence


@dataclass(frozen=True)
class SamplingParams:
    """Mirrors infermesh.v1.SamplingParams, with defaults already resolved."""

    max_tokens: int
    # 0: greedy.
    temperature: float = 0.0
    # In (0, 1]; 1 disables nucleus sampling.
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # Report each output token's logprob (and top_logprobs alternatives) in its chunk.
    logprobs: bool = False
    top_logprobs: int = 0
    # Applied by the worker where it samples (call_codec checks the ranges): OpenAI's presence and
    # frequency penalties over the output, HF's repetition penalty (1: off) over prompt and output,
    # and logit_bias as (token id, bias) pairs by id.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # sampling.structured compiled (structured_output.py): the llguidance grammar; "": free text.
    grammar: str = ""
    # With grammar, a reasoning model's output that may begin as reasoning: the grammar holds only what
    # follows the think block (ModelText.reasoning_start decides); None: the whole output.
    grammar_after_reasoning: GrammarAfterReasoning | None = None
    # Report the prompt's logprobs with this many alternatives each (None: not asked), on the first chunk.
    prompt_logprobs: int | None = None
    # vLLM's top_k (0: off) and min_p (0: off), applied by the worker where it samples.
    top_k: int = 0
    min_p: float = 0.0
    # vLLM's min_tokens (0: off): until this many tokens were generated the worker may not draw
    # min_tokens_ban (stop_token_ids and the model's end ids, those none with ignore_eos) and stop
    # strings are not looked for.
    min_tokens: int = 0
    min_tokens_ban: tuple[int, ...] = ()
    # vLLM's: ids that end the output as the model's end ids do (even with ignore_eos); and whether the
    # matched stop string (or such a token's text) stays in the text.
    stop_token_ids: frozenset[int] = frozenset()
    include_stop_str_in_output: bool = False
    # vLLM's allowed_token_ids (sorted, distinct; empty: every token), which the worker masks to, and its
    # bad_words tokenized (None: none), which each sampling step turns into banned ids (bad_words.py).
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: BadWords | None = None
    # GenerateRequest.embed: the prompt's embedding instead of text (max_tokens 1: the step that reaches the
    # prompt's end returns the vector, and the sequence ends there with nothing generated).
    embed: bool = False
    # The LoRA adapter the sequence runs under (a model name of its own that names it: ModelRegistry);
    # "": the base model. Workers get it in every step; its blocks are cached apart (prefix_cache.cache_salt).
    lora_adapter: str = ""

    @property
    def num_output_positions(self) -> int:
        """The positions past the prompt the sequence may need: an embedding's none."""
        return 0 if self.embed else self.max_tokens

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def needs_history(self) -> bool:
        """Whether the worker needs every token of the sequence to sample it (SequenceStep.context_token_ids):
        a penalty counts them, a grammar's matcher consumes the output."""
        return self.penalized or bool(self.grammar)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS or (self.top_logprobs and not self.logprobs):
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], and 0 without logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}")
        if self.top_k < 0 or not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"top_k must be >= 0 and min_p in [0, 1], got {self.top_k} and {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")


def ending_token_ids(model_end_ids: Iterable[int], ignore_eos: bool, stop_token_ids: frozenset[int]) -> frozenset[int]:
    """The ids that end an output (counted, never streamed): the model's end ids unless ignore_eos, and the
    request's stop_token_ids in any case (vLLM's rule). min_tokens bans these same ids."""
    return stop_token_ids if ignore_eos else frozenset(model_end_ids) | stop_token_ids


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    tenant: TenantContext
    # Monotonic seconds (the scheduler's clock).
    arrival_s: float
    # Monotonic seconds; None: no deadline.
    deadline_s: float | None
    stream: OutputStream
    output_token_ids: list[int] = field(default_factory=list)
    # ending_token_ids() for this request, resolved once at admission: one lookup per generated token.
    ending_token_ids: frozenset[int] = frozenset()
    # Tokens whose KV the current worker holds; 0 after preemption.
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    abort_reason: AbortReason | None = None
    # The next step that mentions this sequence must tell the worker to drop its block table.
    needs_block_table_reset: bool = True
    num_preemptions: int = 0
    first_scheduled_s: float | None = None
    # When it last entered the running set; fairness preemption spares it for a minimum run time.
    running_since_s: float | None = None
    # Prompt tokens billed to the tenant's service counter, or served from the prefix cache: neither a
    # recompute after preemption nor a cached prefix is billed (again).
    num_billed_prompt_tokens: int = 0
    first_token_s: float | None = None
    # When its latest token came back (monotonic seconds, the scheduler's clock); None: none yet.
    last_token_s: float | None = None
    # num_generated once its first token here came back (a continuation's delivered tokens before it).
    first_token_index: int = 0
    # Its TPOT target (GenerateRequest.objectives), seconds; None: none. Paces its decodes (tpot_pacing.py).
    tpot_target_s: float | None = None
    # Prefix cache identity (prefix_cache.py): the tenant's salt, how many leading prompt tokens are a
    # public prefix, and the hashes of the full blocks hashed so far (they depend only on the tokens).
    cache_salt: bytes = b""
    num_public_tokens: int = 0
    block_hashes: list[int] = field(default_factory=list)
    # Tokens reused from the prefix cache at its last admission (0: none, or the cache is off).
    num_cached_tokens: int = 0
    # Prompt tokens never computed for this request because the cache held them (usage.cached_prompt_tokens):
    # num_prompt_tokens minus this is what its tenant was billed for the prompt.
    num_cached_prompt_tokens: int = 0
    # With sampling.logprobs: one entry per output token, None for those a continuation brought.
    output_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    # With sampling.prompt_logprobs: entry j for prompt token j, as the workers report them (None: not
    # yet; the first stays None). Sent once, with the stream's first chunk; a continuation sends none.
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # With sampling.embed: the pooled vector, once the worker returned it.
    embedding: tuple[float, ...] = ()

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether its prompt chunks must report the prompt's logprobs (some are still missing)."""
        return (self.sampling.prompt_logprobs is not None and not self.prompt_logprobs_sent
                and None in self.prompt_logprobs[1:])

    @property
    def priority(self) -> Priority:
        return self.tenant.priority

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_ids(self, start: int, stop: int) -> tuple[int, ...]:
        """all_token_ids[start:stop] without concatenating prompt and output."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:  # decodes and most recomputed tails: output tokens only
            return tuple(self.output_token_ids[start - num_prompt : max(stop - num_prompt, 0)])
        head = self.prompt_token_ids[start:stop]
        tail = self.output_token_ids[max(start - num_prompt, 0) : max(stop - num_prompt, 0)]
        return head + tuple(tail)

    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def is_expired(self, now_s: float) -> bool:
        return self.deadline_s is not None and now_s >= self.deadline_s

    def preemption_key(self) -> tuple[int, float, int]:
        """Larger is preempted first: lowest priority class, then newest."""
        return (int(self.priority), self.arrival_s, self.seq_id)

    def reset_for_recompute(self) -> None:
        """Forget the KV the worker had: prompt + generated tokens become the next prefill."""
        self.num_computed_tokens = 0
        self.needs_block_table_reset = True
        self.status = SequenceStatus.PREEMPTED
        self.running_since_s = None
