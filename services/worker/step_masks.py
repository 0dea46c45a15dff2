"""The grammar masks of one step, computed on a helper thread while the step's forward runs.

The mask a constrained sequence samples under depends only on its output so far, and that is known
when the step is admitted (a decode's input token is the previous step's sample). So the step
executor starts the masks before the forward and waits for them after it: what stays on the step's
critical path is only what the masks take beyond the forward, and one vectorised -inf fill over the
constrained rows. This is vLLM's overlap of the grammar bitmask with the forward, in our words.

It runs in parallel because neither side holds the GIL for its heavy part: llguidance computes a
mask (and builds a matcher) with the GIL released (`LLMatcher.unsafe_compute_mask_ptr`, pyo3's
`py.detach`), and torch's kernels release it too. One helper thread computes the step's masks one
after another, each straight into its row of a bitmask kept between steps (no allocation, no copy);
llguidance's own pool (`LLExecutor`) is not used: on a CPU worker the forward's threads already take
the cores, and one thread keeps each sequence's error its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from services.worker.grammar import GrammarError, GrammarTokenizer, Guide


@dataclass(frozen=True)
class MaskJob:
    """One constrained sequence of the step: the tokens its guide still has to consume, then its mask."""

    grammar: str
    guide: Guide | None  # the sequence's matcher; None: one is built from `grammar` (first sample, or a reset)
    # Output tokens the guide has not consumed (for a new one, the whole output from the grammar's start).
    pending_token_ids: Sequence[int]
    # A token allowed beside the grammar's (a reasoning model's `<think>`, at its output's first token).
    also_allowed: int | None = None


@dataclass(frozen=True)
class StepMasks:
    """The masks of a step's jobs, in job order. A job that failed has an error and no guide; its row is
    garbage, and its sequence fails alone."""

    bitmask: np.ndarray  # int32[len(jobs), words]: bit t of row i (word t // 32, bit t % 32) set = token t allowed
    guides: tuple[Guide | None, ...]
    errors: tuple[GrammarError | None, ...]


class StepMasker:
    """Starts a step's masks on the helper thread (`start`); the caller waits on the future it returns.

    One step at a time: the bitmask's rows are reused, so a step's masks are read before the next starts.
    """

    def __init__(self, tokenizer: GrammarTokenizer) -> None:
        self.tokenizer = tokenizer
        self._num_words = (tokenizer.tokenizer.vocab_size + 31) // 32  # llguidance's row size, exactly
        self._bitmask = np.zeros((0, self._num_words), dtype=np.int32)
        self._thread: ThreadPoolExecutor | None = None  # made on the first constrained step

    def start(self, jobs: Sequence[MaskJob]) -> Future[StepMasks]:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        return self._thread.submit(self.compute, jobs)

    def compute(self, jobs: Sequence[MaskJob]) -> StepMasks:
        """The step's masks on the calling thread (`start` runs it on the helper thread)."""
        if len(jobs) > len(self._bitmask):
            self._bitmask = np.zeros((max(len(jobs), 2 * len(self._bitmask)), self._num_words), dtype=np.int32)
        bitmask = self._bitmask[: len(jobs)]
        guides: list[Guide | None] = []
        errors: list[GrammarError | None] = []
        for job, row in zip(jobs, bitmask, strict=True):
            try:
                guide = job.guide or Guide(self.tokenizer, job.grammar)
                guide.advance(job.pending_token_ids)
                guide.fill_mask(row)
                if job.also_allowed is not None:
                    _allow(row, job.also_allowed)
            except GrammarError as exc:
                guides.append(None)
                errors.append(exc)
                continue
            guides.append(guide)
            errors.append(None)
        return StepMasks(bitmask, tuple(guides), tuple(errors))

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None


def _allow(row: np.ndarray, token_id: int) -> None:
    """Sets token_id's bit in a bitmask row (its words read unsigned: bit 31 is a token like any); an id
    past the tokenizer's vocabulary stays disallowed, as mask_logits leaves it."""
    if token_id < 32 * len(row):
        row.view(np.uint32)[token_id >> 5] |= np.uint32(1 << (token_id & 31))


def mask_logits(logits: np.ndarray, rows: Sequence[int], bitmask: np.ndarray) -> None:
    """Sets logits[rows[i], t] to -inf for every token t that bitmask row i does not allow, in place,
    for all the rows at once. `logits: float[num_rows, vocab]`; tokens past the bitmask's width (a
    vocabulary padded beyond the tokenizer's) are never allowed."""
    if len(rows) != len(bitmask):
        raise ValueError(f"{len(rows)} rows of logits for {len(bitmask)} rows of masks")
    if not len(rows):
        return
    # The int32 words' bytes, least significant first, then each byte's bits, lowest first: token t
    # is bit t of the row (`<u4`: little-endian bytes on any host, a no-op on x86 and ARM). The words
    # are inverted first, so the bits unpack straight into "masked" (0/1 bytes, read as bool).
    width = min(logits.shape[1], 32 * bitmask.shape[1])
    masked = np.unpackbits((~bitmask).astype("<u4", copy=False).view(np.uint8), axis=1, count=width,
                           bitorder="little").view(bool)
    first = rows[0]
    # Every row of a run of decodes is one block of rows: a view, filled in place; else a copy, put back.
    contiguous = list(rows) == list(range(first, first + len(rows)))
    index = np.asarray(rows, dtype=np.intp)
    selected = logits[first : first + len(rows)] if contiguous else logits[index]
    np.copyto(selected[:, :width], -np.inf, where=masked)
    selected[:, width:] = -np.inf
    if not contiguous:
        logits[index] = selected
