"""Embedding requests at the scheduler (GenerateRequest.embed): which model may serve which task, and the
vector a caller gets back.

An embedding model (its workers' hello declares WorkerHello.embedding) serves embed requests only, and a
generator of text never serves them: each refusal names the field and the endpoint that would serve the
request (vLLM answers a request of the other task per model the same way). A request's `dimensions` keeps
the vector's first values, for a Matryoshka model only, renormalized where the model normalizes
(vLLM's order: truncate, then normalize; normalizing the worker's already normalized vector again is the same).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from infermesh.v1 import gateway_pb2
from services.common import errors
from services.scheduler.attach_types import EmbeddingInfo, ModelKey


def check_task(request: gateway_pb2.GenerateRequest, model: ModelKey, embedding: EmbeddingInfo | None) -> int | None:
    """The dimensions an embed request asks for (None: all, or not an embed request); InvalidArgument for a
    request of the task the model does not serve, or an embed request it cannot answer."""
    embed = request.HasField("embed")
    if embedding is None:
        if embed:
            raise errors.InvalidArgument(f"embed: model {model} is not an embedding model (it generates text: use "
                                         "/v1/completions or /v1/chat/completions); /v1/embeddings serves models "
                                         "imported as embedding models")
        return None
    if not embed:
        raise errors.InvalidArgument(f"model {model} is an embedding model: it serves embeddings only "
                                     "(/v1/embeddings, or Generate with embed set), not generated text")
    if request.tools:  # messages are rendered through the chat template, as vLLM's chat embeddings are
        raise errors.InvalidArgument("embed: tools cannot be embedded; send messages, prompt or prompt_token_ids")
    if not request.embed.HasField("dimensions"):
        return None
    dimensions = request.embed.dimensions
    if not embedding.matryoshka:
        raise errors.InvalidArgument(f"embed.dimensions: model {model} does not support shortened embeddings "
                                     "(it is not a Matryoshka model); leave dimensions out")
    if not 1 <= dimensions <= embedding.dimensions:
        raise errors.InvalidArgument(f"embed.dimensions must be in [1, {embedding.dimensions}] (the model's "
                                     f"dimensions), got {dimensions}")
    return dimensions


def shaped(vector: Sequence[float], dimensions: int | None, normalize: bool) -> Sequence[float]:
    """The vector the caller asked for: its first `dimensions` values (None: all), renormalized when the
    model's vectors are normalized."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    kept = vector[:dimensions]
    if not normalize:
        return kept
    norm = math.sqrt(math.fsum(x * x for x in kept))
    return [x / norm for x in kept] if norm > 0 else kept
