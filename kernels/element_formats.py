"""How the CUDA kernels read and write one element of each floating-point format they take.

float32 and float16 are Numba types: an element converts by assignment. bfloat16
is not (and PyTorch exports no ``__cuda_array_interface__`` for it), so a
bfloat16 tensor reaches a kernel viewed as int16 (``as_kernel_array``) and its
bits are converted here: widening is a 16-bit shift (exact), narrowing rounds
to nearest even as PyTorch's ``.to(torch.bfloat16)`` does (NaN stays a quiet
NaN). Under ``NUMBA_ENABLE_CUDASIM=1`` the same conversions run in numpy.

* ``STORAGE[format]``: the array dtype a kernel sees for a format.
* ``widener(format)`` → ``widen(element) -> float32``.
* ``narrower(format)`` → ``narrow(float32) -> element`` (what to assign into an array of that format).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numba import config, cuda, float32

_SIMULATED = bool(config.ENABLE_CUDASIM)  # type: ignore[attr-defined]  # numba.config sets it at import

STORAGE = {"float32": "float32", "float16": "float16", "bfloat16": "int16"}
FORMATS = tuple(STORAGE)


def as_kernel_array(x: Any) -> Any:
    """``x`` as a kernel takes it: a bfloat16 tensor viewed as int16 (same bits, no copy), anything else as it is."""
    dtype = getattr(x, "dtype", None)
    if dtype is not None and str(dtype) == "torch.bfloat16":
        import torch

        return x.view(torch.int16)
    return x


def format_itemsize(fmt: str) -> int:
    return np.dtype(STORAGE[fmt]).itemsize


@functools.cache
def widener(fmt: str):
    if fmt not in STORAGE:
        raise ValueError(f"element format must be one of {FORMATS}; got {fmt!r}")
    if fmt == "bfloat16":
        return bf16_to_float32

    @cuda.jit(device=True, inline=True)
    def widen(element):
        return float32(element)

    return widen


@functools.cache
def narrower(fmt: str):
    if fmt not in STORAGE:
        raise ValueError(f"element format must be one of {FORMATS}; got {fmt!r}")
    if fmt == "bfloat16":
        return float32_to_bf16

    @cuda.jit(device=True, inline=True)
    def narrow(value):
        return value  # the assignment converts (float16: round to nearest even)

    return narrow


def _bf16_bits_to_float(bits) -> np.float32:
    return np.array([np.uint32(np.int16(bits).view(np.uint16)) << np.uint32(16)], np.uint32).view(np.float32)[0]


def _float_to_bf16_bits(value) -> np.int16:
    f = np.float32(value)
    if np.isnan(f):
        return np.int16(0x7FC0)
    bits = int(np.array([f], np.float32).view(np.uint32)[0])
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return np.array([rounded & 0xFFFF], np.uint16).view(np.int16)[0]


if _SIMULATED:

    @cuda.jit(device=True)
    def bf16_to_float32(bits):
        return _bf16_bits_to_float(bits)

    @cuda.jit(device=True)
    def float32_to_bf16(value):
        return _float_to_bf16_bits(value)

else:
    from llvmlite import ir  # type: ignore[import-untyped]  # no stubs
    from numba.cuda.extending import intrinsic

    def _types_of(numba_type):
        import importlib

        return importlib.import_module(type(numba_type).__module__.rsplit(".", 1)[0])

    @intrinsic
    def bf16_to_float32(typingctx, bits):
        if str(bits) not in ("int16", "uint16"):
            return None
        typ = _types_of(bits)

        def codegen(context, builder, signature, args):
            (value,) = args
            wide = builder.shl(builder.zext(value, ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
            return builder.bitcast(wide, ir.FloatType())

        return typ.float32(bits), codegen

    @intrinsic
    def float32_to_bf16(typingctx, value):
        if str(value) != "float32":
            return None
        typ = _types_of(value)

        def codegen(context, builder, signature, args):
            (x,) = args
            i32 = ir.IntType(32)
            bits = builder.bitcast(x, i32)
            odd = builder.and_(builder.lshr(bits, ir.Constant(i32, 16)), ir.Constant(i32, 1))
            rounded = builder.add(builder.add(bits, ir.Constant(i32, 0x7FFF)), odd)
            top = builder.lshr(rounded, ir.Constant(i32, 16))
            is_nan = builder.fcmp_unordered("uno", x, x)
            chosen = builder.select(is_nan, ir.Constant(i32, 0x7FC0), top)
            return builder.trunc(chosen, ir.IntType(16))

        return typ.int16(value), codegen
