"""An AWQ or GPTQ checkpoint's quantized weights: which stored tensors they are, the checks on each
quantized Linear's parts, and their dequantization into the model's parameters (awq_gptq_config reads
the scheme).

A quantized `<module>.weight` ([out, in]) is not stored; its parts are, beside each other:

* AWQ (GEMM): `qweight` int32 `[in, out / 8]`, eight 4-bit codes an int32 along the outputs, in
  AutoAWQ's order: bits `4i..4i+3` hold output `8c + AWQ_ORDER[i]` of column c; `qzeros` int32
  `[in / group, out / 8]`, the zeros packed alike; `scales` `[in / group, out]`.
* GPTQ: `qweight` int32 `[in * bits / 32, out]`, codes packed along the inputs in order (bits
  `b*i..` of row r hold input `r * 32 / b + i`); `qzeros` int32 `[groups, out * bits / 32]` packed
  along the outputs in order, each plus `zero_offset` (1 in the v1 format, which stores zero - 1);
  `scales` `[groups, out]`; `g_idx` int32 `[in]`, each input's group (act-order permutes it; without
  act-order it may be left out, and is then input // group_size).

Input i, output o dequantizes to `(q[i, o] - z[g(i), o]) * s[g(i), o]`, computed in float32: the
difference is a small integer and the scale a float16 (or bfloat16) value, so the product is exact,
and it is rounded once, to the compute dtype, where it lands (in float16, what `(q - z) * s` in
float16 gives, as vLLM's AWQ dequantize and AutoGPTQ's torch path compute it). Which weights are quantized is read from the files: a Linear (attention and MLP
projections, each expert's, a router, lm_head) stores its `qweight` and companions, or a plain
`weight`; every part is checked (present, shape, dtype) before any tensor data is read, and `g_idx`'s
values when it is read. A zero `bias` beside a quantized weight of a model without one (older
AutoGPTQ wrote one on every Linear) is read past; a non-zero one is refused.

A weight is dequantized a slab of inputs at a time, straight into its parameter, once all its parts
are read: loading holds one weight's packed parts and a slab of float32, never a second model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from services.worker.models.awq_gptq_config import AWQ, PACKED_BITS, IntQuantization
from services.worker.models.fp8_weights import StoredTensor, is_linear_weight
from services.worker.models.llama_config import CheckpointError

# AutoAWQ's order of outputs within an int32: the code in bits 4i..4i+3 is output AWQ_ORDER[i] of its eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_UNPACK = tuple(AWQ_ORDER.index(o) for o in range(8))  # output o's place among the eight
PACKED_DTYPE = "I32"
SCALE_DTYPES = ("F16", "BF16", "F32")  # AutoAWQ and AutoGPTQ write float16; the model's dtype, elsewhere
# AutoGPTQ's older QuantLinear stored a bias on every quantized Linear, zeros where the model has none
# (vLLM reads such biases past): accepted beside a quantized weight, and only if zero.
EXTRA_BIAS = "bias"
_SLAB_VALUES = 1 << 22  # dequantized a slab of inputs at a time: about this many float32 values


@dataclass(frozen=True)
class IntWeight:
    """One quantized Linear weight as stored: its parts, by part name (qweight, qzeros, scales, g_idx,
    and a zero bias read past)."""

    parts: dict[str, StoredTensor]


def _some_part(parts: Mapping[str, StoredTensor]) -> StoredTensor:
    """The part an error about the whole weight names: its qweight, else another of its packed parts."""
    return parts.get("qweight") or next(p for n, p in parts.items() if n != EXTRA_BIAS)


class IntTensors:
    """The quantized side of an AWQ or GPTQ checkpoint, gathered while its headers are read (`take`),
    then checked whole (`check`)."""

    def __init__(self, quantization: IntQuantization, expected: Mapping[str, tuple[int, ...]]) -> None:
        self.quantization = quantization
        self.expected = expected
        self.parts: dict[str, dict[str, StoredTensor]] = {}  # the weight's model name → its parts

    def take(self, model_name: str, tensor: StoredTensor) -> bool:
        """Whether the tensor is a quantized weight's part, which is gathered here; the tensors it is not
        are the checkpoint's own (expected_tensors')."""
        module, _, part = model_name.rpartition(".")
        extra_bias = part == EXTRA_BIAS and model_name not in self.expected
        if part not in self.quantization.part_names and not extra_bias:
            return False
        parts = self.parts.setdefault(f"{module}.weight", {})
        if part in parts:
            raise CheckpointError(str(tensor.path), tensor.name, f"the same tensor as {parts[part].name} in "
                                  f"{parts[part].path}")
        parts[part] = tensor
        return True

    def check(self, stored: Mapping[str, tuple[Path, str]]) -> dict[str, IntWeight]:
        """Each quantized weight, by its model name. `stored`: the tensors stored as they are (a weight
        there is not quantized). CheckpointError names the first part that is missing, misplaced, or
        not of its layout's shape and dtype."""
        checked = {}
        for weight, parts in self.parts.items():
            checked[weight] = self._check(weight, parts, stored)
        return checked

    def _check(self, weight: str, parts: dict[str, StoredTensor], stored: Mapping[str, tuple[Path, str]]) -> IntWeight:
        shape = self._placed(weight, parts, stored)
        self._complete(parts)
        self._laid_out(shape, parts)
        return IntWeight(dict(parts))

    def _placed(self, weight: str, parts: dict[str, StoredTensor], stored: Mapping[str, tuple[Path, str]]) -> tuple[int, int]:
        """The weight's [out, in]; CheckpointError unless it is a Linear weight of the model stored only quantized."""
        if parts.keys() == {EXTRA_BIAS}:
            bias = parts[EXTRA_BIAS]
            raise CheckpointError(str(bias.path), bias.name, "unexpected tensor: the model has no bias here (a "
                                  "zero bias is read past only beside a quantized weight)")
        some = _some_part(parts)
        shape = self.expected.get(weight)
        if shape is None or not is_linear_weight(weight, shape):
            raise CheckpointError(str(some.path), some.name, f"a quantized part of {weight}, which is not a "
                                  "Linear weight of this model (only Linear weights are quantized)")
        if weight in stored:
            path, name = stored[weight]
            raise CheckpointError(str(some.path), some.name, f"beside {name} in {path}: a Linear weight is "
                                  "stored quantized or as it is, not both")
        out, in_ = shape
        return out, in_

    def _complete(self, parts: dict[str, StoredTensor]) -> None:
        some = _some_part(parts)
        prefix = some.name.rpartition(".")[0]
        for part in self.quantization.required_parts:
            if part not in parts:
                why = " (quantization_config.desc_act is true: each input's group is stored)" if part == "g_idx" else ""
                raise CheckpointError(str(some.path), f"{prefix}.{part}", f"missing beside {some.name}{why}")

    def _laid_out(self, shape: tuple[int, int], parts: dict[str, StoredTensor]) -> None:
        """CheckpointError unless the layout can hold the weight and each part has its shape and dtype."""
        problem = self.quantization.layout_problem(shape)
        if problem is not None:
            qweight = parts["qweight"]
            raise CheckpointError(str(qweight.path), qweight.name, f"cannot hold a [{shape[0]}, {shape[1]}] "
                                  f"weight: {problem}")
        expected_shapes = {**self.quantization.part_shapes(shape), EXTRA_BIAS: (shape[0],)}
        for part, tensor in parts.items():
            if tensor.shape != expected_shapes[part]:
                raise CheckpointError(str(tensor.path), tensor.name, f"shape {list(tensor.shape)}, but "
                                      f"{self._layout()} stores a {list(shape)} weight's {part} as "
                                      f"{list(expected_shapes[part])}")
            dtypes = SCALE_DTYPES if part in ("scales", EXTRA_BIAS) else (PACKED_DTYPE,)
            if tensor.dtype not in dtypes:
                raise CheckpointError(str(tensor.path), tensor.name, f"dtype {tensor.dtype} is not supported for "
                                      f"{part}; supported: {', '.join(dtypes)}")

    def _layout(self) -> str:
        q = self.quantization
        group = "one group" if q.group_size is None else f"group_size {q.group_size}"
        return f"{q.method} {q.bits}-bit with {group}"


def unpack_along_columns(packed: torch.Tensor, bits: int, places: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 `[rows, cols * 32 / bits]`: each int32 of `packed` ([rows, cols]) as its codes, lowest bits
    first, or the code in place `places[j]` (counted from the lowest bits) as the j-th."""
    order = torch.arange(PACKED_BITS // bits, dtype=torch.int32) if places is None else torch.tensor(
        places, dtype=torch.int32)
    codes = (packed.unsqueeze(-1) >> order * bits) & ((1 << bits) - 1)  # arithmetic shift, masked: the sign is gone
    return codes.reshape(packed.shape[0], -1)


def unpack_along_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 `[rows * 32 / bits, cols]`: each int32 of `packed` ([rows, cols]) as a column of its codes."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32).view(1, -1, 1)
    codes = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1, packed.shape[1])


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 `[rows, cols * 8]`: AWQ's packed codes or zeros ([rows, cols]) in output order."""
    return unpack_along_columns(packed, 4, _AWQ_UNPACK)


class Dequantizer:
    """One quantized weight's parts, read: writes `(q - z) * s` into a `[out, in]` target, a slab of
    inputs at a time."""

    def __init__(self, quantization: IntQuantization, parts: Mapping[str, torch.Tensor]) -> None:
        self.q = quantization
        self.qweight = parts["qweight"]
        self.scales = parts["scales"].to(torch.float32)
        qzeros = parts["qzeros"]
        zeros = unpack_awq(qzeros) if quantization.method == AWQ else unpack_along_columns(qzeros, quantization.bits)
        self.zeros = zeros + quantization.zero_offset
        self.in_features = self.qweight.shape[0] * (1 if quantization.method == AWQ else quantization.pack_factor)
        g_idx = parts.get("g_idx")
        if g_idx is None:
            size = self.q.group_size or self.in_features
            self.groups = torch.arange(self.in_features) // size
        else:
            self.groups = g_idx.to(torch.int64)

    def bad_group(self) -> int | None:
        """An input whose group (g_idx) is not one of the scales' rows; None when all are."""
        bad = ((self.groups < 0) | (self.groups >= self.scales.shape[0])).nonzero()
        return None if bad.numel() == 0 else int(bad[0])

    def write(self, target: torch.Tensor) -> None:
        """`target` (`[out, in]`, any dtype and device) ← the dequantized weight, rounded once to its dtype."""
        out = self.scales.shape[1]
        step = max(32, _SLAB_VALUES // out // 32 * 32)  # whole int32s of GPTQ's packed inputs
        for begin in range(0, self.in_features, step):
            end = min(begin + step, self.in_features)
            target[:, begin:end].copy_(self._slab(begin, end).T)

    def _slab(self, begin: int, end: int) -> torch.Tensor:
        """float32 `[end - begin, out]`: inputs begin..end of the weight, dequantized."""
        if self.q.method == AWQ:
            codes = unpack_awq(self.qweight[begin:end])
        else:
            pack = self.q.pack_factor
            codes = unpack_along_rows(self.qweight[begin // pack:-(-end // pack)], self.q.bits)
        groups = self.groups[begin:end]
        return (codes - self.zeros[groups]).to(torch.float32).mul_(self.scales[groups])


def dequantize(quantization: IntQuantization, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """float32 `[out, in]`: a quantized weight from its parts (qweight, qzeros, scales, and g_idx if stored)."""
    dequantizer = Dequantizer(quantization, parts)
    weight = torch.empty(dequantizer.scales.shape[1], dequantizer.in_features)
    dequantizer.write(weight)
    return weight


class IntGroup:
    """One quantized weight's place in the model, filled once all its parts have been read (in any order,
    from one weight file or several)."""

    def __init__(self, target: torch.Tensor, quantization: IntQuantization, stored: IntWeight) -> None:
        self.target = target
        self.quantization = quantization
        self.stored = stored
        self._read: dict[str, torch.Tensor] = {}
        self.done = False

    def receive(self, part: str, tensor: torch.Tensor) -> None:
        self._read[part] = tensor
        self._fill()

    def _fill(self) -> None:
        if self._read.keys() != self.stored.parts.keys():
            return
        bias = self._read.get(EXTRA_BIAS)
        if bias is not None and bool(bias.any()):
            stored = self.stored.parts[EXTRA_BIAS]
            raise CheckpointError(str(stored.path), stored.name, "a non-zero bias on a Linear the model has no "
                                  "bias for (only zero biases beside quantized weights are read past)")
        dequantizer = Dequantizer(self.quantization, self._read)
        bad = dequantizer.bad_group()
        if bad is not None:
            g_idx = self.stored.parts["g_idx"]
            raise CheckpointError(str(g_idx.path), g_idx.name, f"input {bad}'s group is "
                                  f"{int(dequantizer.groups[bad])}, not one of the {dequantizer.scales.shape[0]} "
                                  "groups its scales hold")
        dequantizer.write(self.target)
        self._read.clear()  # the packed copy is not kept
        self.done = True
