"""An embedding model's pooling: a prompt's final hidden states -> one vector (sentence-transformers'
Pooling module, then its Normalize module when the model has one).

The worker computes a prompt in chunks (chunked prefill), in order, each step giving the hidden states of
the chunk's positions after the final norm (transformers' last_hidden_state). `PooledSequence` keeps
what its pooling needs between chunks, on the model's device: the latest position's state (last token),
the running sum and count (mean), or position 0's state (CLS). A chunk that starts at position 0 begins
again (the first step, or a recompute after preemption); any other chunk must continue exactly where
the last one ended, or the vector would pool positions it never saw.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch


class Pooling(enum.Enum):
    LAST = "last"  # the last prompt token's state (Qwen3-Embedding, gte-Qwen2, e5-mistral)
    MEAN = "mean"  # the mean over every prompt position
    CLS = "cls"  # the first position's state

    @classmethod
    def of(cls, value: str) -> Pooling:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"pooling must be one of {', '.join(p.value for p in cls)}, got {value!r}") from None


@dataclass(frozen=True)
class PoolingSpec:
    pooling: Pooling
    normalize: bool  # unit L2 norm (the model's Normalize module)


class PooledSequence:
    """One prompt's pooling so far."""

    def __init__(self, pooling: Pooling) -> None:
        self._pooling = pooling
        self._state: torch.Tensor | None = None  # last: latest state; mean: the sum (float64); cls: position 0's
        self._count = 0
        self.next_position = 0  # where the next chunk must start (0 also begins again)

    def add(self, hidden: torch.Tensor, start_position: int) -> None:
        """`hidden float32[n, d]`: the final hidden states of positions [start_position, start_position + n).
        ValueError for a chunk that neither begins again nor continues the last one."""
        if start_position == 0:
            self._state, self._count = None, 0
        elif start_position != self.next_position:
            raise ValueError(f"a pooled prompt's chunk starts at position {start_position}, but its chunks so far "
                             f"end at {self.next_position}: every position must be computed here, in order")
        if self._pooling is Pooling.LAST:
            self._state = hidden[-1]
        elif self._pooling is Pooling.MEAN:
            total = hidden.double().sum(dim=0)
            self._state = total if self._state is None else self._state + total
        elif start_position == 0:
            self._state = hidden[0]
        self._count += len(hidden)
        self.next_position = start_position + len(hidden)

    def vector(self, normalize: bool) -> np.ndarray:
        """The pooled vector, float32 on the host."""
        if self._state is None:
            raise ValueError("no position of the prompt was pooled")
        pooled = self._state / self._count if self._pooling is Pooling.MEAN else self._state
        if normalize:
            pooled = torch.nn.functional.normalize(pooled.double(), dim=0)
        return pooled.float().cpu().numpy()


def pool_dense(hidden: torch.Tensor, spec: PoolingSpec) -> np.ndarray:
    """The whole prompt's hidden states `float32[T, d]` at once (the golden check's and the tests' form)."""
    pooled = PooledSequence(spec.pooling)
    pooled.add(hidden, 0)
    return pooled.vector(spec.normalize)
