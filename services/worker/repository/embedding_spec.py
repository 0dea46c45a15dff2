"""The manifest's `generator.embedding`: the generator is an embedding model (a sentence-transformers
checkpoint), served by /v1/embeddings and never asked for text.

    "embedding": {"pooling": "last" | "mean" | "cls", "normalize": true, "dimensions": 1024,
                  "matryoshka": false, "golden": [{"prompt_ids": [...], "expected": [...]}]}

`golden` replaces the generator's greedy golden cases (a base model has no LM head to be greedy with):
each prompt's vector through the worker's paged path and pooling, recorded at import in float32, which
the worker's golden check holds within GOLDEN_TOLERANCE of its largest value (another CPU, thread count
or chunking rounds differently); a worker computing in bfloat16 or float16 rounds each layer to 8 or 11
bits, so its vectors are held to the recorded ones' direction and length instead (REDUCED_MIN_COSINE,
REDUCED_NORM_TOLERANCE).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from services.worker.pooling import Pooling, PoolingSpec
from services.worker.repository.json_fields import JsonFields

GOLDEN_TOLERANCE = 1e-3
REDUCED_MIN_COSINE = 0.99
REDUCED_NORM_TOLERANCE = 0.05


@dataclass(frozen=True)
class GoldenEmbedding:
    prompt_ids: tuple[int, ...]
    expected: tuple[float, ...]

    def to_json(self) -> dict[str, Any]:
        return {"prompt_ids": list(self.prompt_ids), "expected": [round(v, 7) for v in self.expected]}

    def matches(self, got: np.ndarray, *, reduced_precision: bool = False) -> bool:
        """Whether `got` is the recorded vector as this worker's compute dtype can give it."""
        want = np.asarray(self.expected, dtype=np.float64)
        got = np.asarray(got, dtype=np.float64)
        if got.shape != want.shape:
            return False
        if not reduced_precision:
            return bool(np.max(np.abs(got - want)) <= GOLDEN_TOLERANCE * max(1.0, float(np.max(np.abs(want)))))
        norms = float(np.linalg.norm(got)), float(np.linalg.norm(want))
        if min(norms) == 0:
            return norms[0] == norms[1]
        cosine = float(got @ want) / (norms[0] * norms[1])
        return cosine >= REDUCED_MIN_COSINE and abs(norms[0] / norms[1] - 1) <= REDUCED_NORM_TOLERANCE


@dataclass(frozen=True)
class EmbeddingSpec:
    pooling: Pooling
    normalize: bool
    dimensions: int  # each vector's length: the model's hidden size
    # Trained so that a prefix of the vector is an embedding too (Matryoshka): requests may ask for fewer.
    matryoshka: bool = False
    golden: tuple[GoldenEmbedding, ...] = ()

    @property
    def pooling_spec(self) -> PoolingSpec:
        return PoolingSpec(self.pooling, self.normalize)

    @classmethod
    def from_json(cls, e: JsonFields, vocab_size: int, max_seq_len: int) -> EmbeddingSpec:
        e.allow_only("pooling", "normalize", "dimensions", "matryoshka", "golden")
        try:
            pooling = Pooling.of(e.raw("pooling"))
        except ValueError as exc:
            raise e.fail("pooling", str(exc)) from None
        dimensions = e.integer("dimensions", 1)
        golden = []
        for g in e.items("golden", 1):
            g.allow_only("prompt_ids", "expected")
            prompt = g.ints("prompt_ids", 0, vocab_size)
            if len(prompt) > max_seq_len:
                raise g.fail("prompt_ids", f"is longer than max_seq_len {max_seq_len}")
            golden.append(GoldenEmbedding(prompt, g.numbers("expected", dimensions)))
        return cls(pooling, _boolean(e, "normalize"), dimensions, _boolean(e, "matryoshka", default=False),
                   tuple(golden))

    def to_json(self) -> dict[str, Any]:
        return {"pooling": self.pooling.value, "normalize": self.normalize, "dimensions": self.dimensions,
                "matryoshka": self.matryoshka, "golden": [g.to_json() for g in self.golden]}


def _boolean(e: JsonFields, key: str, default: bool | None = None) -> bool:
    value = e.data.get(key, default) if default is not None else e.raw(key)
    if not isinstance(value, bool):
        raise e.fail(key, f"must be true or false, got {value!r}")
    return value
