"""Plain data the worker's executors take and give back.

They mirror `BatchItem`/`ItemResult`/`ItemError` and `RunStep`/`SequenceStep`/
`SequenceOutput` in protos/infermesh/v1/scheduler.proto, so the executors stay
free of protobuf; the servicer converts at the edge.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from services.common.grammar_after_reasoning import GrammarAfterReasoning
from services.common.logprobs import PositionLogprobs


class ErrorCode(enum.IntEnum):
    """The google.rpc.Code values a per-item or per-sequence error carries."""

    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    INTERNAL = 13


@dataclass(frozen=True)
class ItemError:
    code: ErrorCode
    message: str


# --- classify ---------------------------------------------------------------


@dataclass(frozen=True)
class RawImage:
    pixels: bytes  # row-major HWC uint8, exactly height * width * channels bytes
    height: int
    width: int
    channels: int  # 1 (grey), 3 (RGB) or 4 (RGBA; alpha dropped)


@dataclass(frozen=True)
class BatchItem:
    item_id: int
    image: bytes | RawImage  # bytes: an encoded PNG or JPEG file
    top_k: int = 1  # labels to return, >= 1; more than the model has returns them all


@dataclass(frozen=True)
class Label:
    label: str
    index: int  # class index in the model's output
    score: float  # softmax probability in [0, 1]


@dataclass(frozen=True)
class ItemResult:
    """Labels for one item, or the error that item failed with alone."""

    item_id: int
    labels: tuple[Label, ...] = ()
    error: ItemError | None = None


# --- generate ---------------------------------------------------------------


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0  # nucleus mass in (0, 1]; 0 is read as 1, like the proto
    seed: int | None = None  # None: the worker draws one per sequence (not reproducible across workers)
    logprobs: bool = False  # report the sampled token's log-probability (SequenceOutput.logprobs)
    top_logprobs: int = 0  # with logprobs: also the most likely tokens, 0..MAX_TOP_LOGPROBS
    presence_penalty: float = 0.0  # OpenAI's, [-2, 2]: off at 0
    frequency_penalty: float = 0.0  # OpenAI's, [-2, 2]: off at 0
    repetition_penalty: float = 1.0  # HF's, (0, 2]: off at 1
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), by id
    grammar: str = ""  # SequenceStep.grammar: the llguidance grammar the output must match; "": none
    # SequenceStep.grammar_after_reasoning: the grammar holds only what follows the think block; None: all.
    grammar_after_reasoning: GrammarAfterReasoning | None = None
    top_k: int = 0  # vLLM's: keep the top_k most likely tokens; 0: off
    min_p: float = 0.0  # vLLM's: drop tokens below min_p x the most likely one's probability; 0: off
    # vLLM's: the only ids the sample may be (every other logit -inf before anything else); (): every id.
    allowed_token_ids: tuple[int, ...] = ()

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def needs_history(self) -> bool:
        """Whether sampling needs the sequence's tokens (penalties count them, a grammar consumes the output)."""
        return self.penalized or bool(self.grammar)


# Not frozen, though never changed once built: the worker decodes one per sequence per step, and a frozen
# dataclass's __init__ costs ~3x (an object.__setattr__ per field).
@dataclass(slots=True)
class SequenceStep:
    seq_id: int
    token_ids: tuple[int, ...]  # tokens to compute this step (prompt chunk, recomputed tokens, or last sample)
    start_position: int  # position of token_ids[0] = tokens whose KV is already cached
    new_blocks: tuple[int, ...] = ()  # physical KV blocks appended to the block table, in order
    reset_block_table: bool = False  # drop the worker's table before appending new_blocks
    sample: bool = False  # sample a next token after the last of token_ids
    sampling: SamplingParams = SamplingParams()
    num_generated: int = 0  # tokens generated so far: the index of the token sampled now
    # With reset_block_table: positions [0, num_cached_tokens) of the new table already hold this
    # sequence's KV (blocks the scheduler reuses from its prefix cache); 0: the new table holds nothing.
    num_cached_tokens: int = 0
    # Compute the token this worker sampled for the sequence in its previous step (token_ids empty):
    # the scheduler sent this step before that result (WorkerCapacity.max_steps_in_flight >= 2).
    input_from_last_sample: bool = False
    # With reset_block_table and a penalized sampling: the tokens at [0, start_position) (the cached prefix).
    context_token_ids: tuple[int, ...] = ()
    # Report the logprobs of the prompt tokens this chunk predicts, with this many alternatives
    # (None: none): token_ids[1:], then next_prompt_token_id's (a chunk ending before the prompt).
    prompt_logprobs: int | None = None
    next_prompt_token_id: int | None = None
    # Ids the sample must not be (min_tokens: the model's end ids until enough were generated).
    banned_token_ids: tuple[int, ...] = ()
    # The LoRA adapter the sequence runs under (WorkerHello.lora_adapters); "": the base model.
    lora_adapter: str = ""


@dataclass(frozen=True)
class RunStep:
    step_id: int
    seqs: tuple[SequenceStep, ...]
    finished_seq_ids: tuple[int, ...] = ()  # forget these block tables before running the step


# Not frozen: one per sequence per step (see SequenceStep).
@dataclass(slots=True)
class SequenceOutput:
    seq_id: int
    token_id: int | None = None  # set only when the step had sample=True and succeeded
    logprob: float | None = None  # log-probability of token_id under the sampling distribution
    error: ItemError | None = None
    logprobs: PositionLogprobs | None = None  # with sampling.logprobs
    prompt_logprobs: tuple[PositionLogprobs, ...] = ()  # with SequenceStep.prompt_logprobs
    # An embedding model's, on the step that ends the prompt: the pooled vector (token_id stays None).
    embedding: tuple[float, ...] = ()


# --- timings ----------------------------------------------------------------


@dataclass(frozen=True)
class StageDurations:
    """Worker stages of one batch or step, seconds."""

    decode_s: float = 0.0
    preprocess_s: float = 0.0
    compute_s: float = 0.0
    postprocess_s: float = 0.0
