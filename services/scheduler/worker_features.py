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
    """Each value is what a request asks for that relies on it, as a refusal names it."""

    # SequenceStep.grammar: structured output masks what the grammar cannot take.
    STRUCTURED_OUTPUT = "sampling.structured"
    # SequenceStep.grammar_after_reasoning: the grammar waits for the think block to end.
    GRAMMAR_AFTER_REASONING = "a grammar after the reasoning"

    @property
    def wire_name(self) -> str:
        """As infermesh.v1.WorkerFeature names it (error messages quote it)."""
        return f"WORKER_FEATURE_{self.name}"


def needed_features(sampling: SamplingParams) -> frozenset[WorkerFeature]:
    """The features every step of a sequence sampled with `sampling` relies on."""
    needed = set()
    if sampling.grammar:
        needed.add(WorkerFeature.STRUCTURED_OUTPUT)
    if sampling.grammar_after_reasoning is not None:
        needed.add(WorkerFeature.GRAMMAR_AFTER_REASONING)
    return frozenset(needed)


def described(features: Iterable[WorkerFeature]) -> str:
    """`features` as a refusal names them: what the request asked for, and the declaration it needs."""
    return ", ".join(sorted(f"{feature.value} ({feature.wire_name})" for feature in features))
