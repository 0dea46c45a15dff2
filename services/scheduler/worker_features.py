"""What a generator worker declares it honours beyond a plain step (WorkerHello.features), and what a
sequence needs of the worker it runs on.

A worker ignores a SequenceStep field it does not know, so a step that relies on one must go only to
a worker that declared it: with an older worker the output would change and nothing would say so.
A worker that declared nothing (every older one) gets only what every worker honours.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from services.scheduler.sequence import SamplingParams


class WorkerFeature(enum.Enum):
    # SequenceStep.grammar_after_reasoning: the grammar waits for the think block to end.
    GRAMMAR_AFTER_REASONING = "grammar_after_reasoning"

    @property
    def wire_name(self) -> str:
        """As infermesh.v1.WorkerFeature names it (error messages quote it)."""
        return f"WORKER_FEATURE_{self.name}"


def needed_features(sampling: SamplingParams) -> frozenset[WorkerFeature]:
    """The features every step of a sequence sampled with `sampling` relies on."""
    needed = set()
    if sampling.grammar_after_reasoning is not None:
        needed.add(WorkerFeature.GRAMMAR_AFTER_REASONING)
    return frozenset(needed)


def wire_names(features: Iterable[WorkerFeature]) -> str:
    return ", ".join(sorted(feature.wire_name for feature in features))
