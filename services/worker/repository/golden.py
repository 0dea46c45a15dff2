"""The golden check: the manifest's fixed inputs through the serving path, against the recorded outputs.

It runs at load, before the worker attaches, so a version whose weights and recorded
behaviour disagree is never served. Each kind registers its check in GOLDEN_CHECKS.
"""

from __future__ import annotations

from collections.abc import Callable

from services.worker.repository.errors import GoldenCheckFailed
from services.worker.repository.loader import LoadedModel
from services.worker.repository.manifest import ModelKind


def run_golden_check(model: LoadedModel) -> None:
    """Runs the manifest's fixed inputs through the serving path; GoldenCheckFailed on any mismatch."""
    GOLDEN_CHECKS[model.manifest.kind](model)


def _classifier(model: LoadedModel) -> None:
    """Through the preprocessing kernel and the CNN: each image's top-1 class."""
    m = model.manifest
    assert m.classifier is not None  # GOLDEN_CHECKS is keyed by the manifest's kind
    images = m.classifier.golden
    probs = model.classifier.classify([g.array() for g in images])
    got = [int(i) for i in probs.argmax(axis=1)]
    want = [g.expected_top1 for g in images]
    if got != want:
        raise GoldenCheckFailed(f"{m.name}/{m.version}: golden images classified as {got}, expected {want}")


def _generator(model: LoadedModel) -> None:
    """Through the paged KV path with chunked prefill: each prompt's greedy continuation."""
    m = model.manifest
    assert m.generator is not None
    block_size = m.envelope.block_size
    for i, golden in enumerate(m.generator.golden):
        got = model.generator.greedy_paged(
            golden.prompt_ids, len(golden.expected_ids), block_size=block_size,
            prefill_chunk=max(1, m.envelope.max_num_batched_tokens // 2),
        )
        if tuple(got) != golden.expected_ids:
            raise GoldenCheckFailed(
                f"{m.name}/{m.version}: golden prompt {i} continued as {got}, expected {list(golden.expected_ids)}"
            )


GOLDEN_CHECKS: dict[ModelKind, Callable[[LoadedModel], None]] = {
    ModelKind.CLASSIFIER: _classifier,
    ModelKind.GENERATOR: _generator,
}
