"""Runs one classify batch: decode → preprocess kernel → model → top-k labels.

An item that cannot be decoded or asks for something impossible fails alone
with INVALID_ARGUMENT; the rest of the batch runs. Stage times are measured
with the injected clock for the whole batch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from services.common.clock import Clock
from services.common.errors import InvalidArgument
from services.worker.image_decode import decode_image
from services.worker.models.classifier import Classifier
from services.worker.work import BatchItem, ErrorCode, ItemError, ItemResult, Label, StageDurations


class BatchExecutor:
    def __init__(self, classifier: Classifier, clock: Clock = time.perf_counter, max_batch_size: int = 64) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.classifier = classifier
        self.clock = clock
        self.max_batch_size = max_batch_size  # the model runs at most this many images at once

    def execute(self, items: Sequence[BatchItem]) -> tuple[list[ItemResult], StageDurations]:
        """One result per item, in order, and the batch's stage durations."""
        t_start = self.clock()
        errors: dict[int, ItemError] = {}
        images: dict[int, np.ndarray] = {}
        for pos, item in enumerate(items):
            try:
                images[pos] = self._decode(item)
            except InvalidArgument as exc:
                errors[pos] = ItemError(ErrorCode.INVALID_ARGUMENT, exc.message)
        t_decoded = self.clock()

        ok = sorted(images)
        chunks = [ok[i:i + self.max_batch_size] for i in range(0, len(ok), self.max_batch_size)]
        batches = [self.classifier.preprocess([images[pos] for pos in chunk]) for chunk in chunks]
        t_preprocessed = self.clock()

        probs = [self.classifier.predict_proba(batch) for batch in batches]
        t_computed = self.clock()

        probs_by_pos = {pos: row for chunk, p in zip(chunks, probs, strict=True) for pos, row in zip(chunk, p, strict=True)}
        results = [
            ItemResult(item.item_id, error=errors[pos]) if pos in errors
            else ItemResult(item.item_id, labels=self._top_k(probs_by_pos[pos], item.top_k))
            for pos, item in enumerate(items)
        ]
        t_done = self.clock()
        return results, StageDurations(
            decode_s=t_decoded - t_start,
            preprocess_s=t_preprocessed - t_decoded,
            compute_s=t_computed - t_preprocessed,
            postprocess_s=t_done - t_computed,
        )

    def _decode(self, item: BatchItem) -> np.ndarray:
        if item.top_k < 1:
            raise InvalidArgument(f"top_k must be >= 1, got {item.top_k}")
        c = self.classifier
        return decode_image(item.image, channels=c.channels, max_image_pixels=c.max_image_pixels)

    def _top_k(self, probs: np.ndarray, k: int) -> tuple[Label, ...]:
        order = np.argsort(-probs, kind="stable")[:k]
        return tuple(Label(self.classifier.labels[i], int(i), float(probs[i])) for i in order)
