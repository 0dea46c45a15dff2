"""A brought TorchScript or ONNX model behind one call: named numpy arrays in, named arrays out.

The file is opened as it is (torch.jit.load, or an onnxruntime InferenceSession), then checked
against the manifest's declared inputs and outputs, so a manifest that does not describe its
model is refused at load rather than at the first request. Both run on the worker's thread
count: torch's pools are set by thread_settings; ONNX Runtime's intra-op pool is sized here, with
one inter-op thread (the graph runs sequentially: one batch at a time per worker).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from services.common.tensor_datatypes import NUMPY_DTYPES
from services.worker.repository.errors import IncompatibleWeights
from services.worker.repository.tensor_spec import ONNX, TORCHSCRIPT, TensorIO, TensorSpec

# onnxruntime's element type names (NodeArg.type) for each KServe datatype.
ONNX_TYPES: dict[str, str] = {
    "BOOL": "tensor(bool)", "UINT8": "tensor(uint8)", "UINT16": "tensor(uint16)", "UINT32": "tensor(uint32)",
    "UINT64": "tensor(uint64)", "INT8": "tensor(int8)", "INT16": "tensor(int16)", "INT32": "tensor(int32)",
    "INT64": "tensor(int64)", "FP16": "tensor(float16)", "FP32": "tensor(float)", "FP64": "tensor(double)",
}
# Where onnxruntime's load errors name the op it cannot run.
_OP_PATTERNS = (
    re.compile(r"No Op registered for (\S+)"),
    re.compile(r"(\S+)\(-?\d+\) is not a registered function/op"),
    re.compile(r"of operator \((\S+)\)"),
    re.compile(r"Could not find an implementation for (\S+)"),
)


class TensorModel(Protocol):
    device: str  # as torch names it: 'cpu', 'cuda:0'

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One batch: every declared input (batch on dim 0) -> every declared output, same batch."""


def open_tensor_model(spec: TensorSpec, path: Path, device: str, num_threads: int) -> TensorModel:
    if spec.format == TORCHSCRIPT:
        return TorchScriptModel(spec, path, device)
    if spec.format == ONNX:
        return OnnxModel(spec, path, device, num_threads)
    raise IncompatibleWeights(f"{path}: no runtime for format {spec.format!r}")


def dtype_of(io: TensorIO) -> np.dtype:
    return np.dtype(NUMPY_DTYPES[io.datatype])


class TorchScriptModel:
    """torch.jit.load'ed module; the declared inputs are its positional arguments, in order."""

    def __init__(self, spec: TensorSpec, path: Path, device: str) -> None:
        import torch

        self._torch = torch
        self._spec = spec
        self.device = device
        try:
            with warnings.catch_warnings():
                # torch 2.13 marks TorchScript deprecated; it still loads, and it is what users bring.
                warnings.simplefilter("ignore", DeprecationWarning)
                self._module = torch.jit.load(str(path), map_location=device).eval()
        except (RuntimeError, ValueError) as exc:
            raise IncompatibleWeights(f"{path} is not a TorchScript module torch {torch.__version__} loads: "
                                      f"{str(exc).splitlines()[0]}") from None

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return _named_outputs(self._spec, self.run_positional(inputs))

    def run_positional(self, inputs: Mapping[str, np.ndarray]) -> tuple[np.ndarray, ...]:
        """What forward() returns (a tensor, or a tuple or list of them), in its order."""
        torch = self._torch
        with torch.inference_mode():
            args = [torch.from_numpy(np.ascontiguousarray(inputs[io.name])).to(self.device) for io in self._spec.inputs]
            out = self._module(*args)
        values = tuple(out) if isinstance(out, tuple | list) else (out,)
        if not all(isinstance(v, torch.Tensor) for v in values):
            raise IncompatibleWeights(f"forward() returned {type(out).__name__} holding "
                                      f"{[type(v).__name__ for v in values]}; tensor models return tensors")
        return tuple(v.detach().cpu().numpy() for v in values)


class OnnxModel:
    """An onnxruntime InferenceSession: CPU execution provider, or CUDA's on a GPU worker."""

    def __init__(self, spec: TensorSpec, path: Path, device: str, num_threads: int) -> None:
        import onnxruntime as ort

        self._spec = spec
        self.device = device
        options = ort.SessionOptions()
        options.intra_op_num_threads = num_threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        providers: list[Any] = ["CPUExecutionProvider"]
        if device != "cpu":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise IncompatibleWeights(f"{path}: --device {device} but this onnxruntime build has no CUDA "
                                          f"execution provider (it has {ort.get_available_providers()})")
            providers = [("CUDAExecutionProvider", {"device_id": int(device.partition(":")[2] or 0)}),
                         "CPUExecutionProvider"]
        try:
            self._session = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as exc:  # onnxruntime raises its own pybind classes (Fail, InvalidGraph, ...)
            raise IncompatibleWeights(unloadable_onnx_message(path, str(exc), ort.__version__)) from None
        _check_onnx_signature(spec, path, self._session)
        self._output_names = [o.name for o in spec.outputs]

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return _named_outputs(self._spec, self.run_positional(inputs))

    def run_positional(self, inputs: Mapping[str, np.ndarray]) -> tuple[np.ndarray, ...]:
        """The declared outputs, in the manifest's order."""
        feed = {io.name: np.ascontiguousarray(inputs[io.name]) for io in self._spec.inputs}
        return tuple(np.asarray(v) for v in self._session.run(self._output_names, feed))


def short_error(exc: BaseException) -> str:
    """The line that says what went wrong: TorchScript's errors end it after a page of traceback."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def unloadable_onnx_message(path: Path, error: str, version: str) -> str:
    """Names the op onnxruntime cannot run when its message says which."""
    for pattern in _OP_PATTERNS:
        found = pattern.search(error)
        if found:
            return f"{path}: onnxruntime {version} cannot run op {found.group(1)!r}: {error}"
    return f"{path}: onnxruntime {version} cannot load the model: {error}"


def _check_onnx_signature(spec: TensorSpec, path: Path, session: Any) -> None:
    for what, declared, graph in (("input", spec.inputs, session.get_inputs()),
                                  ("output", spec.outputs, session.get_outputs())):
        by_name = {arg.name: arg for arg in graph}
        if what == "input" and sorted(by_name) != sorted(io.name for io in declared):
            raise IncompatibleWeights(f"{path}: the graph's inputs are {sorted(by_name)}, "
                                      f"the manifest declares {[io.name for io in declared]}")
        for io in declared:
            arg = by_name.get(io.name)
            if arg is None:
                raise IncompatibleWeights(f"{path}: the graph has no {what} {io.name!r} (it has {sorted(by_name)})")
            if arg.type != ONNX_TYPES[io.datatype]:
                raise IncompatibleWeights(f"{path}: {what} {io.name!r} is {arg.type} in the graph, "
                                          f"the manifest declares {io.datatype}")
            if len(arg.shape) != len(io.dims):
                raise IncompatibleWeights(f"{path}: {what} {io.name!r} has rank {len(arg.shape)} in the graph, "
                                          f"the manifest declares dims {list(io.dims)}")


def _named_outputs(spec: TensorSpec, values: tuple[np.ndarray, ...]) -> dict[str, np.ndarray]:
    if len(values) != len(spec.outputs):
        raise IncompatibleWeights(f"the model returned {len(values)} outputs; the manifest declares "
                                  f"{[o.name for o in spec.outputs]}")
    return dict(zip((o.name for o in spec.outputs), values, strict=True))
