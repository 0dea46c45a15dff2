"""Which steps replay a captured decode graph, and how the worker captures them at start.

A step whose every sequence brings one new token and wants that token's logits
(no prompt chunk, no prompt logprobs), with no more sequences than the largest
captured batch, replays a decode graph (services/worker/models/cuda_graphs.py);
every other step runs eagerly through `Generator.step`. Both return the same
thing: logits `float32[num_rows, vocab]`, one row per sequence in step order.

A mixture-of-experts model (Mixtral, Qwen MoE) is never captured: how many rows
each expert runs depends on each step's routing, which the host reads every
layer (models/experts.py), and a graph records fixed sizes and no host read.
Its decode steps run eagerly, as a log line at start says.

Graphs are an optimisation, never a condition of serving: a capture that fails,
or whose replay disagrees with the eager step, leaves the worker serving
eagerly with a warning saying why; so does a replay that raises mid-serving
(from then on every step is eager).

Invariant (the graphs'): the KV cache captured is the executor's, allocated once
in StepExecutor.__init__ and never reallocated or resized while it lives.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from typing import Protocol

import torch

from services.worker.models.cuda_graphs import DEFAULT_BUCKETS, DecodeGraphs, kernel_capture_problem
from services.worker.models.generator import Generator
from services.worker.models.llama_config import LlamaFamilyConfig
from services.worker.models.paged import KVCache, PagedSequence

log = logging.getLogger(__name__)

# A replay against the eager step at start: rounding apart (a bucket's padded matmul may pick another
# kernel, in float16 too), a graph reading the wrong blocks or rows is off by the logits' own scale.
PARITY_RTOL = 0.05
PARITY_ATOL = 1e-3
PARITY_PROMPT = (65, 66, 67, 68, 69)  # a few tokens, prefilled eagerly before the checked decode step


class StepPath(enum.Enum):
    GRAPH = "graph"
    EAGER = "eager"


class DecodeGraphRunner(Protocol):
    """What the executor replays: `DecodeGraphs`, or a fake in tests."""

    @property
    def buckets(self) -> tuple[int, ...]: ...

    def refusal(self, seqs: Sequence[PagedSequence]) -> str | None: ...

    def run(self, seqs: Sequence[PagedSequence], *, checked: bool = False) -> torch.Tensor: ...


def step_path(seqs: Sequence[PagedSequence], graphs: DecodeGraphRunner | None) -> StepPath:
    """GRAPH when the graphs take the step whole; else EAGER (prefill chunks, mixed steps, all_logits
    sequences, a batch above the largest bucket, no graphs)."""
    if graphs is None or not seqs:
        return StepPath.EAGER
    return StepPath.GRAPH if graphs.refusal(seqs) is None else StepPath.EAGER


def capture_buckets(max_batch_size: int, max_num_seqs: int) -> tuple[int, ...]:
    """The default buckets up to the smaller of the two limits, that limit included (a step never has
    more sequences than max_num_seqs, so a larger graph would never replay)."""
    limit = min(max_batch_size, max_num_seqs) if max_num_seqs > 0 else max_batch_size
    if limit < 1:
        raise ValueError(f"the largest captured batch must be >= 1, got {limit}")
    return (*(b for b in DEFAULT_BUCKETS if b < limit), limit)


def build_decode_graphs(generator: Generator, cache: KVCache, *, max_batch_size: int,
                        max_num_seqs: int) -> DecodeGraphs | None:
    """The decode graphs over the executor's `cache`, captured and checked against the eager step;
    None (with a warning giving the reason) when they cannot be, so the worker serves eagerly.

    Runs at start with no sequence live: the check writes a few tokens' KV into the first blocks."""
    if cache.device.type != "cuda":
        return None
    never = model_capture_refusal(generator)
    if never is not None:
        log.info("CUDA graphs off, every step runs eagerly: %s", never)
        return None
    try:
        with torch.cuda.device(cache.device):
            problem = kernel_capture_problem(cache.device)
            if problem is not None:
                log.warning("CUDA graphs off, every step runs eagerly: a Numba kernel launch cannot be "
                            "captured here: %s", problem)
                return None
            max_blocks_per_seq = min(-(-generator.max_seq_len // cache.block_size), cache.num_blocks)
            graphs = DecodeGraphs(generator.lm, cache, max_blocks_per_seq=max_blocks_per_seq,
                                  buckets=capture_buckets(max_batch_size, max_num_seqs))
            graphs.capture()
            mismatch = eager_mismatch(graphs, generator, cache)
    except Exception as error:  # GraphCaptureError, or anything torch/Numba raise while capturing
        log.warning("CUDA graphs off, every step runs eagerly: %s: %s", type(error).__name__, error)
        return None
    if mismatch is not None:
        log.warning("CUDA graphs off, every step runs eagerly: a replay disagrees with the eager step: %s", mismatch)
        return None
    seconds = graphs.capture_seconds()
    log.info("CUDA graphs captured for decode batches of %s sequences (%.2f s: %s); larger or non-decode "
             "steps run eagerly", ", ".join(map(str, graphs.buckets)), sum(seconds.values()),
             ", ".join(f"{b}: {s:.2f} s" for b, s in sorted(seconds.items())))
    return graphs


def model_capture_refusal(generator: Generator) -> str | None:
    """Why this model's decode step is never captured, whatever the device; None when it may be."""
    config = generator.config
    if isinstance(config, LlamaFamilyConfig) and config.experts is not None:
        return (f"{config.architecture} is a mixture of experts, whose rows per expert follow each step's "
                "routing (read on the host every layer), and a graph records fixed sizes and no host read")
    return None


def eager_mismatch(graphs: DecodeGraphs, generator: Generator, cache: KVCache) -> str | None:
    """One decode step replayed and run eagerly, at one sequence and at a padded batch (3, when the
    cache has the blocks); None when the logits agree, else how far apart they are."""
    blocks_each = -(-(len(PARITY_PROMPT) + 1) // cache.block_size)
    for batch in (1, 3):
        if batch > max(graphs.buckets) or batch * blocks_each > cache.num_blocks:
            continue
        tables = [tuple(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(batch)]
        generator.step([PagedSequence(PARITY_PROMPT, 0, t, needs_logits=False) for t in tables], cache)
        decode = [PagedSequence((70 + i,), len(PARITY_PROMPT), t, needs_logits=True) for i, t in enumerate(tables)]
        eager = generator.step(decode, cache)
        graphed = graphs.run(decode)
        if graphed.shape != eager.shape:
            return f"batch {batch}: logits {tuple(graphed.shape)} against {tuple(eager.shape)}"
        diff = float((graphed - eager).abs().max())
        bound = PARITY_RTOL * float(eager.abs().max()) + PARITY_ATOL
        if not diff <= bound:  # NaN fails too
            return f"batch {batch}: max |graph - eager| {diff:.3g} above {bound:.3g}"
    return None
