"""The Attach protocol's messages as the scheduler's logic sees them: plain frozen data.

`attach_codec.py` converts them to and from protobuf; the pools, the registry and `WorkerLink`
see only these. Counts are `num_*`, times carry their unit, 0 in a capacity field means "not
declared" (the scheduler's own limit or default applies).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from services.common.errors import InfermeshError
from services.common.logprobs import PositionLogprobs
from services.common.timings import StageTime
from services.scheduler.model_text import ModelText
from services.scheduler.step_plan import StepPlan
from services.scheduler.tokenizer_spec import TokenizerSpec
from services.scheduler.worker_features import WorkerFeature


@dataclass(frozen=True)
class ModelKey:
    name: str
    version: str

    def __str__(self) -> str:
        return f"{self.name}:{self.version}"


class ModelKind(enum.Enum):
    CLASSIFIER = "classifier"
    GENERATOR = "generator"

    @property
    def wire_name(self) -> str:
        """As infermesh.v1.ModelKind names it (error messages quote it)."""
        return f"MODEL_KIND_{self.name}"


@dataclass(frozen=True)
class WorkerCapacity:
    max_batch_size: int = 0
    num_kv_blocks: int = 0
    block_size: int = 0
    max_seq_len: int = 0
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    # Steps the worker takes before answering the first; >= 2: it fills in SequenceStep's
    # input_from_last_sample, so its next step may be sent before the last one's result.
    max_steps_in_flight: int = 0
    # Steps the worker takes in one command (run back to back, answered together); <= 1: one per command.
    max_steps_per_command: int = 0
    # Classifier: the worker's time for a batch of max_batch_size, warmed up at load; the batcher's
    # estimate for that size until one is measured (DynamicBatcher.add_worker). 0: unknown.
    warm_batch_time_s: float = 0.0


@dataclass(frozen=True)
class EmbeddingInfo:
    """An embedding model's vectors, as its worker declares them (infermesh.v1.EmbeddingSpec)."""

    dimensions: int
    normalize: bool
    matryoshka: bool
    pooling: str


@dataclass(frozen=True)
class WorkerHello:
    """What a worker declares when it attaches; `kind` is None when it named none."""

    worker_id: str
    model: ModelKey
    kind: ModelKind | None
    capacity: WorkerCapacity
    protocol_version: int
    labels: tuple[str, ...] = ()
    tokenizer: TokenizerSpec = TokenizerSpec()
    # Classifier: the input size the model was trained on, pixels.
    input_height: int = 0
    input_width: int = 0
    # Tensor model (MODEL_KIND_TENSOR, scheduled as a classifier): its declared inputs and outputs, the
    # TensorMetadata messages passed through to ListModels untouched; empty for every other model.
    tensor_inputs: tuple[object, ...] = ()
    tensor_outputs: tuple[object, ...] = ()
    preferred_batch_sizes: tuple[int, ...] = ()  # the model's own; the scheduler's flag wins when set
    # Generator: its recommended sampling, (SamplingParams field name, value) for each it recommends;
    # what GenerateRequest.model_default_fields asks for.
    sampling_defaults: tuple[tuple[str, float], ...] = ()
    # Generator: what it honours beyond a plain step (worker_features.py); empty: an older worker.
    features: frozenset[WorkerFeature] = frozenset()
    # Generator: set for an embedding model (WorkerHello.embedding), which serves embed requests only.
    embedding: EmbeddingInfo | None = None
    # Generator: the LoRA adapters the worker serves over the model (WorkerHello.lora_adapters).
    lora_adapters: tuple[str, ...] = ()
    # Generator: its tokenizer and chat template, built by the Attach session from `tokenizer` (and
    # the file that followed the hello); None until then (GeneratePool builds a BYTES one itself).
    text: ModelText | None = None


# -- scheduler -> worker -----------------------------------------------------


@dataclass(frozen=True)
class BatchItemCommand:
    item_id: int
    # The request's image message, passed through to the codec untouched: decoding it here would
    # copy its bytes for nothing (the scheduler never looks inside an image).
    image: object
    top_k: int
    trace_context: Mapping[str, str]
    # Unix seconds; None: no deadline.
    deadline_unix_s: float | None
    # A tensor model's request: its Tensor messages, passed through as the image is (image is None then).
    inputs: Sequence[object] = ()


@dataclass(frozen=True)
class BatchCommand:
    batch_id: int
    items: tuple[BatchItemCommand, ...]
    deadline_unix_s: float | None


class StepSequenceContext(Protocol):
    """What a step's sequence carries to the worker beyond its StepPlan entry (a GenerateStream)."""

    @property
    def seed(self) -> int: ...

    @property
    def trace_context(self) -> Mapping[str, str]: ...


@dataclass(frozen=True)
class StepCommand:
    plan: StepPlan
    # By seq_id; a sequence missing here (its stream just ended) is sent without sampling or trace.
    sequences: Mapping[int, StepSequenceContext]


@dataclass(frozen=True)
class StepsCommand:
    """Steps to run in order, in one message, their results coming back in one (RunSteps)."""

    plans: tuple[StepPlan, ...]
    sequences: Mapping[int, StepSequenceContext]


@dataclass(frozen=True)
class AbortCommand:
    seq_ids: tuple[int, ...]


@dataclass(frozen=True)
class DrainCommand:
    grace_ms: int


Command = BatchCommand | StepCommand | StepsCommand | AbortCommand | DrainCommand


# -- worker -> scheduler -----------------------------------------------------


@dataclass(frozen=True)
class Label:
    label: str
    index: int
    score: float


@dataclass(frozen=True)
class ItemOutcome:
    labels: tuple[Label, ...] = ()
    # A tensor model's outputs: the worker's Tensor messages, passed through to the response untouched.
    outputs: tuple[object, ...] = ()
    # The worker's error for this item (its status and message); None when it has labels.
    error: InfermeshError | None = None


@dataclass(frozen=True)
class BatchOutcome:
    items: Mapping[int, ItemOutcome]
    worker_stages: tuple[StageTime, ...]
    worker_total_us: int


@dataclass(frozen=True)
class StepOutcome:
    # Sampled token by seq_id, for the sequences the worker served.
    token_ids: Mapping[int, int]
    # The worker's error (its status code and message) by seq_id, for the sequences it failed.
    failures: Mapping[int, InfermeshError]
    worker_total_s: float
    # By seq_id, for the sampled sequences whose request asked for logprobs.
    logprobs: Mapping[int, PositionLogprobs] = field(default_factory=dict)
    # By seq_id, for the prompt chunks that asked (SequenceStep.prompt_logprobs): one per prompt token predicted.
    prompt_logprobs: Mapping[int, tuple[PositionLogprobs, ...]] = field(default_factory=dict)
    # By seq_id, for the embedding sequences whose prompt the step ended: the pooled vector.
    embeddings: Mapping[int, tuple[float, ...]] = field(default_factory=dict)
