"""Plain data the tensor executor takes and gives back: tensors as KServe carries them.

They mirror the tensor fields of `BatchItem`/`ItemResult` in protos/infermesh/v1/scheduler.proto,
so the executor stays free of protobuf (model_runtime.py converts at the edge).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.worker.work import ItemError


@dataclass(frozen=True)
class WireTensor:
    name: str
    datatype: str  # a KServe datatype (services/common/tensor_datatypes.py)
    shape: tuple[int, ...]  # batch on dim 0
    data: bytes  # raw little-endian elements, row-major: prod(shape) * element size bytes


@dataclass(frozen=True)
class TensorItem:
    """One request: its inputs, each with the same batch size on dim 0."""

    item_id: int
    inputs: tuple[WireTensor, ...]


@dataclass(frozen=True)
class TensorResult:
    """Every declared output of one item, or the error that item failed with alone."""

    item_id: int
    outputs: tuple[WireTensor, ...] = ()
    error: ItemError | None = None
