"""Runs one batch of tensor requests: check each item -> group by shape -> stack -> model -> split.

Items whose inputs have the same shape past the batch dim are stacked on dim 0 (in arrival order)
into runs of at most `max_batch_size` rows; an item of another shape runs in a run of its own
shape, never padded. An item that breaks the declared signature fails alone with
INVALID_ARGUMENT naming the input and what was expected; the rest of the batch runs. A run the
model itself refuses fails its items alone, with the model's message.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kernels import preprocess_images
from services.common.clock import Clock
from services.common.errors import InvalidArgument
from services.common.tensor_datatypes import ELEMENT_SIZE_BYTES, NUMPY_DTYPES
from services.worker.models.tensor_model import TensorModel, dtype_of, short_error
from services.worker.repository.tensor_spec import TensorIO, TensorSpec
from services.worker.tensor_work import TensorItem, TensorResult, WireTensor
from services.worker.work import ErrorCode, ItemError, StageDurations

ShapeKey = tuple[tuple[int, ...], ...]  # each input's shape past the batch dim, in declared order


@dataclass(frozen=True)
class _Checked:
    pos: int  # the item's position in the batch
    num_rows: int  # its batch size (dim 0)
    arrays: dict[str, np.ndarray]  # what the model takes, images already preprocessed

    @property
    def shape_key(self) -> ShapeKey:
        return tuple(a.shape[1:] for a in self.arrays.values())


class TensorExecutor:
    def __init__(self, model: TensorModel, spec: TensorSpec, max_batch_size: int,
                 clock: Clock = time.perf_counter) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.spec = spec
        self.max_batch_size = max_batch_size  # rows (dim 0) the model runs at once
        self.clock = clock

    def execute(self, items: Sequence[TensorItem]) -> tuple[list[TensorResult], StageDurations]:
        """One result per item, in order, and the batch's stage durations."""
        t_start = self.clock()
        errors: dict[int, ItemError] = {}
        checked: list[_Checked] = []
        for pos, item in enumerate(items):
            try:
                checked.append(self._check(pos, item))
            except InvalidArgument as exc:
                errors[pos] = ItemError(ErrorCode.INVALID_ARGUMENT, exc.message)
        t_checked = self.clock()

        outputs: dict[int, tuple[WireTensor, ...]] = {}
        for run in self._runs(checked):
            try:
                outputs.update(self._run(run))
            except Exception as exc:  # the model refused this run: its items fail, the others stand
                for c in run:
                    errors[c.pos] = ItemError(ErrorCode.INVALID_ARGUMENT, f"the model failed on this input: {short_error(exc)}")
        t_computed = self.clock()
        results = [TensorResult(item.item_id, error=errors[pos]) if pos in errors
                   else TensorResult(item.item_id, outputs=outputs[pos]) for pos, item in enumerate(items)]
        return results, StageDurations(decode_s=t_checked - t_start, compute_s=t_computed - t_checked,
                                       postprocess_s=self.clock() - t_computed)

    def _check(self, pos: int, item: TensorItem) -> _Checked:
        given = {t.name: t for t in item.inputs}
        declared = [io.name for io in self.spec.inputs]
        extra = sorted(set(given) - set(declared))
        if extra:
            raise InvalidArgument(f"unexpected input(s) {extra}; the model takes {declared}")
        if len(given) != len(item.inputs):
            raise InvalidArgument("an input is given more than once")
        missing = [name for name in declared if name not in given]
        if missing:
            raise InvalidArgument(f"missing input(s) {missing}; the model takes {declared}")
        arrays = {io.name: self._array(io, given[io.name]) for io in self.spec.inputs}
        rows = {name: a.shape[0] for name, a in arrays.items()}
        if len(set(rows.values())) != 1:
            raise InvalidArgument(f"inputs must share one batch size (dim 0), got {rows}")
        num_rows = next(iter(rows.values()))
        if num_rows > self.max_batch_size:
            raise InvalidArgument(f"input {declared[0]!r} has a batch of {num_rows}; "
                                  f"the model takes at most {self.max_batch_size} (its max_batch_size)")
        return _Checked(pos, num_rows, arrays)

    def _array(self, io: TensorIO, tensor: WireTensor) -> np.ndarray:
        if tensor.datatype != io.wire_datatype:
            raise InvalidArgument(f"input {io.name!r} must be {io.wire_datatype}, got {tensor.datatype}")
        if not io.accepts(tensor.shape):
            raise InvalidArgument(f"input {io.name!r} must have shape {list(io.wire_dims)} (-1: any size >= 1), "
                                  f"got {list(tensor.shape)}")
        expected = math.prod(tensor.shape) * ELEMENT_SIZE_BYTES[tensor.datatype]
        if len(tensor.data) != expected:
            raise InvalidArgument(f"input {io.name!r} of shape {list(tensor.shape)} {tensor.datatype} needs "
                                  f"{expected} bytes, got {len(tensor.data)}")
        array = np.frombuffer(tensor.data, dtype=NUMPY_DTYPES[tensor.datatype]).reshape(tensor.shape)
        if io.image is None:
            return array
        height, width = tensor.shape[1], tensor.shape[2]
        if height * width > io.image.max_image_pixels:
            raise InvalidArgument(f"input {io.name!r} images are {height}x{width}, above the model's "
                                  f"{io.image.max_image_pixels} pixels")
        return np.asarray(preprocess_images(list(array), io.dims[2], io.dims[3], io.image.mean, io.image.std))

    def _runs(self, checked: list[_Checked]) -> list[list[_Checked]]:
        """Items grouped by shape (first appearance order), each group cut into runs of <= max rows."""
        groups: dict[ShapeKey, list[list[_Checked]]] = {}
        for c in checked:
            runs = groups.setdefault(c.shape_key, [[]])
            if sum(x.num_rows for x in runs[-1]) + c.num_rows > self.max_batch_size:
                runs.append([])
            runs[-1].append(c)
        return [run for runs in groups.values() for run in runs if run]

    def _run(self, run: list[_Checked]) -> dict[int, tuple[WireTensor, ...]]:
        feed = {io.name: np.concatenate([c.arrays[io.name] for c in run]) for io in self.spec.inputs}
        got = self.model.run(feed)
        total = sum(c.num_rows for c in run)
        out: dict[str, np.ndarray] = {}
        for io in self.spec.outputs:
            array = np.asarray(got[io.name])
            if array.ndim == 0 or array.shape[0] != total:
                raise RuntimeError(f"output {io.name!r} has shape {list(array.shape)}, not a batch of {total}")
            out[io.name] = np.ascontiguousarray(array.astype(dtype_of(io), copy=False))
        results: dict[int, tuple[WireTensor, ...]] = {}
        start = 0
        for c in run:
            results[c.pos] = tuple(
                WireTensor(io.name, io.datatype, (c.num_rows, *out[io.name].shape[1:]),
                           out[io.name][start:start + c.num_rows].tobytes())
                for io in self.spec.outputs)
            start += c.num_rows
        return results
