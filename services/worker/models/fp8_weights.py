"""An FP8 checkpoint's quantized weights: which stored tensors they are, the checks on each weight and
its scale, and their dequantization into the model's parameters (fp8_config says the schemes).

A quantized weight is a Linear weight (a 2-D `<module>.weight`, not the embedding: attention and MLP
projections, each expert's, a router, lm_head) stored as float8_e4m3fn with its scale beside it,
`<module>.weight_scale_inv` or `<module>.weight_scale`. Which weights are quantized is read from the
files, so an lm_head or router the scheme leaves out (`ignore`, `modules_to_not_convert`) is simply
stored in the checkpoint's dtype. Every pair is checked before any tensor data is read: a float8
weight without its scale, a scale without a float8 weight (a weight stored otherwise), a scale of the
wrong shape or dtype, float8 anywhere but a Linear weight, and e5m2 are refused naming the tensor.

Dequantization is `float32(weight) * float32(scale)`, one scale per block, row or tensor, rounded once
to float32 (exact for float32 compute: the product of a 4-bit significand and a 24-bit one is rounded
once) and then to the compute dtype. The worker holds the dequantized weights, not the FP8 ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from services.worker.models.fp8_config import PER_BLOCK, PER_CHANNEL, PER_TENSOR, Fp8Quantization
from services.worker.models.llama_config import CheckpointError

QUANTIZED_DTYPE = "F8_E4M3"  # safetensors' name for float8_e4m3fn
SCALE_DTYPES = ("F32", "BF16", "F16")  # fp8 checkpoints store float32 scales; llm-compressor's, the model's dtype
_EMBEDDING = "model.embed_tokens.weight"


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a weight file's header describes it."""

    path: Path
    name: str  # as stored
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, F8_E4M3, ...


def is_linear_weight(model_name: str, shape: tuple[int, ...]) -> bool:
    """Whether a checkpoint tensor (the model's name, its expected shape) is one a scheme may quantize."""
    return model_name.endswith(".weight") and len(shape) == 2 and model_name != _EMBEDDING


class Fp8Tensors:
    """The FP8 side of a checkpoint, gathered while its headers are read (`take`), then checked whole
    (`check`): every float8 weight with its scale, every scale with its float8 weight."""

    def __init__(self, quantization: Fp8Quantization, expected: Mapping[str, tuple[int, ...]]) -> None:
        self.quantization = quantization
        self.expected = expected
        self.weights: dict[str, StoredTensor] = {}  # model name of a float8 weight → where it is
        self.scales: dict[str, StoredTensor] = {}  # model name of the weight a scale scales → the scale
        self.input_scales: dict[str, StoredTensor] = {}  # likewise, static activation scales (not used)

    def take_scale(self, model_name: str, tensor: StoredTensor) -> bool:
        """Whether the tensor is a scale (or a static activation scale), which is gathered here; the
        tensors it is not are the checkpoint's own (expected_tensors')."""
        companion = self._companion(model_name)
        if companion is None:
            return False
        kind, weight = companion
        gathered = self.scales if kind == self.quantization.scale_name else self.input_scales
        if weight in gathered:
            raise CheckpointError(str(tensor.path), tensor.name, f"the same tensor as {gathered[weight].name} in "
                                  f"{gathered[weight].path}")
        gathered[weight] = tensor
        return True

    def add_weight(self, model_name: str, tensor: StoredTensor) -> None:
        """A float8 tensor of the checkpoint's (its shape checked); CheckpointError unless a Linear weight."""
        if not is_linear_weight(model_name, tensor.shape):
            raise CheckpointError(str(tensor.path), tensor.name, f"dtype {QUANTIZED_DTYPE}, but only Linear weights "
                                  "(<module>.weight: projections, experts, routers, lm_head) are quantized")
        self.weights[model_name] = tensor

    def _companion(self, model_name: str) -> tuple[str, str] | None:
        """(its kind, the weight's model name) of a scale's model name; None for any other name."""
        module, _, kind = model_name.rpartition(".")
        if kind == self.quantization.scale_name or kind in self.quantization.input_scale_names:
            return kind, f"{module}.weight"
        return None

    def check(self) -> dict[str, StoredTensor]:
        """Each float8 weight's scale, by the weight's model name. CheckpointError names the first tensor
        that is not a weight and scale pair of the scheme's shapes and dtypes."""
        for weight, scale in self.scales.items():
            self._check_scale(weight, scale)
        for weight, tensor in self.weights.items():
            if weight not in self.scales:
                raise CheckpointError(str(tensor.path), tensor.name, f"dtype {QUANTIZED_DTYPE} without its scale "
                                      f"{tensor.name.removesuffix('weight')}{self.quantization.scale_name}")
        for weight, tensor in self.input_scales.items():
            if weight not in self.weights:
                raise CheckpointError(str(tensor.path), tensor.name, f"an activation scale for {weight}, which is "
                                      f"not a {QUANTIZED_DTYPE} weight")
            if tensor.shape not in ((), (1,)):
                raise CheckpointError(str(tensor.path), tensor.name, f"shape {list(tensor.shape)}; supported: [1] "
                                      "(one scale per tensor)")
        return self.scales

    def _check_scale(self, weight: str, scale: StoredTensor) -> None:
        shape = self.expected.get(weight)
        if shape is None or not is_linear_weight(weight, shape):
            raise CheckpointError(str(scale.path), scale.name, f"a scale for {weight}, which is not a Linear "
                                  "weight of this model")
        if weight not in self.weights:
            raise CheckpointError(str(scale.path), scale.name, f"a scale for {weight}, which is not stored as "
                                  f"{QUANTIZED_DTYPE} (a quantized weight's dtype; e5m2 is not supported)")
        shapes = self.quantization.scale_shapes(shape)
        if scale.shape not in shapes:
            raise CheckpointError(str(scale.path), scale.name, f"shape {list(scale.shape)} but {self._scaled_by()} "
                                  f"of a {list(shape)} weight takes {' or '.join(str(list(s)) for s in shapes)}")
        if scale.dtype not in SCALE_DTYPES:
            raise CheckpointError(str(scale.path), scale.name, f"dtype {scale.dtype} is not supported for a scale; "
                                  f"supported: {', '.join(SCALE_DTYPES)}")

    def _scaled_by(self) -> str:
        q = self.quantization
        return f"one scale per {q.block[0]} x {q.block[1]} block" if q.block else f"one scale per {q.granularity}"


def dequantize(weight: torch.Tensor, scale: torch.Tensor, quantization: Fp8Quantization) -> torch.Tensor:
    """`float32[out, in]`: a float8_e4m3fn `[out, in]` weight times its scale, which covers the whole
    tensor (`[1]`), a row each (`[out, 1]`) or a block each (`[ceil(out / rows), ceil(in / cols)]`)."""
    values = weight.to(torch.float32)
    scale = scale.to(torch.float32)
    if quantization.granularity == PER_TENSOR:
        return values.mul_(scale.reshape(()))
    if quantization.granularity == PER_CHANNEL:
        return values.mul_(scale.reshape(-1, 1))
    assert quantization.granularity == PER_BLOCK and quantization.block is not None
    rows, cols = quantization.block
    per_row = scale.repeat_interleave(rows, dim=0)[: values.shape[0]]  # [out, column blocks]
    for j in range(per_row.shape[1]):  # a strip of columns at a time: no weight-sized scale tensor
        values[:, j * cols:(j + 1) * cols].mul_(per_row[:, j:j + 1])
    return values


class Fp8Pair:
    """One quantized weight's place in the model, filled once its float8 weight and its scale have both
    been read (in either order, from one weight file or two)."""

    def __init__(self, target: torch.Tensor, quantization: Fp8Quantization) -> None:
        self.target = target
        self.quantization = quantization
        self._weight: torch.Tensor | None = None
        self._scale: torch.Tensor | None = None
        self.done = False

    def receive_weight(self, weight: torch.Tensor) -> None:
        self._weight = weight
        self._fill()

    def receive_scale(self, scale: torch.Tensor) -> None:
        self._scale = scale
        self._fill()

    def _fill(self) -> None:
        if self._weight is None or self._scale is None:
            return
        self.target.copy_(dequantize(self._weight, self._scale, self.quantization))
        self._weight = self._scale = None  # the float8 copy is not kept
        self.done = True
