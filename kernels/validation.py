"""Shape and dtype checks shared by the public kernel functions.

Messages name the argument, its documented layout and what was passed, e.g.
``key_cache must be float32[num_blocks, block_size, num_kv_heads, head_size];
got int64 with shape (2, 3)``.
"""

from __future__ import annotations

from typing import Any

from kernels.backend import dtype_name


def check_array(name: str, x: Any, *, dtypes: tuple[str, ...], layout: tuple[str, ...]) -> tuple[int, ...]:
    """Checks ``x``'s dtype and rank against the layout; returns its shape."""
    expected = f"{'|'.join(dtypes)}[{', '.join(layout)}]"
    shape = getattr(x, "shape", None)
    if shape is None or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an array {expected}; got {type(x).__name__}")
    shape = tuple(int(s) for s in shape)
    got_dtype = dtype_name(x)
    if got_dtype not in dtypes or len(shape) != len(layout):
        raise ValueError(f"{name} must be {expected}; got {got_dtype} with shape {shape}")
    return shape


def check_dim(name: str, axis_name: str, got: int, want: int, want_from: str) -> None:
    if got != want:
        raise ValueError(f"{name}: {axis_name} is {got} but {want_from} says {want}")


def check_contiguous(name: str, x: Any) -> None:
    """In-place outputs must be C-contiguous: a kernel cannot write through a copy."""
    if hasattr(x, "is_contiguous"):  # torch
        contiguous = x.is_contiguous()
    elif hasattr(x, "is_c_contiguous"):  # numba device array
        contiguous = x.is_c_contiguous()
    else:
        contiguous = x.flags.c_contiguous
    if not contiguous:
        raise ValueError(f"{name} must be C-contiguous (it is written in place)")
