"""Launching compiled Numba CUDA kernels on PyTorch tensors without Numba's per-call argument machinery.

Measured on an H200 (numba-cuda, 2026-11-27): a `write_kv_cache` of 256
tokens cost 0.37 ms per call through the generic path against 0.05 ms for
PyTorch's `index_copy_`, nearly all of it host time: each tensor became a
Numba device array (`as_cuda_array`: array-interface parsing, a driver
pointer query, a device-array object), then the dispatcher typed every
argument and `_prepare_args` flattened it again. A decode step calls two
kernels per layer, so this was most of a small model's step on a GPU.

This module keeps, per kernel and per argument-type signature, the compiled
kernel that the first (generic) launch produced, and launches it afterwards
straight through `cuda.core.launch` with the arguments flattened from the
tensors themselves, in Numba's array ABI: meminfo, parent, number of items,
item size, data pointer, shape, strides in bytes. It is used only where that
launch API exists (numba-cuda); anything unexpected turns it off for the
process and the generic path carries on. ``INFERMESH_KERNEL_FAST_LAUNCH=0``
turns it off too (the benchmark compares both).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import Any

log = logging.getLogger(__name__)

ENV_VAR = "INFERMESH_KERNEL_FAST_LAUNCH"
_compiled: dict[tuple, Any] = {}
_state: dict[str, bool | None] = {"enabled": None}


def enabled() -> bool:
    if _state["enabled"] is None:
        _state["enabled"] = os.environ.get(ENV_VAR, "1") != "0" and _launch_api() is not None
    return bool(_state["enabled"])


def set_enabled(flag: bool) -> None:
    """For benchmarks comparing the two paths."""
    _state["enabled"] = flag and _launch_api() is not None


def disable(reason: str) -> None:
    if _state["enabled"]:
        log.warning("fast kernel launch disabled, using Numba's generic launch: %s", reason)
    _state["enabled"] = False


@functools.cache
def _launch_api():
    try:
        from numba.cuda import dispatcher
    except ImportError:
        return None
    launch, config = getattr(dispatcher, "launch", None), getattr(dispatcher, "LaunchConfig", None)
    return (launch, config) if launch is not None and config is not None else None


def signature_key(kernel: Any, args: list[Any]) -> tuple:
    return (id(kernel), *(_arg_key(a) for a in args))


def _arg_key(arg: Any) -> tuple:
    if isinstance(arg, bool):
        raise TypeError("bool kernel arguments are not supported by the fast launch")
    if isinstance(arg, int):
        return ("int",)
    if isinstance(arg, float):
        return ("float",)
    return (arg.dtype, arg.dim(), arg.is_contiguous())


def remember(kernel: Any, args: list[Any], views: list[Any]) -> None:
    """After a generic launch: keep the compiled kernel that served these argument types."""
    if not enabled():
        return
    try:
        argtypes = tuple(kernel.typeof_pyval(v) for v in views)
        compiled = kernel.overloads.get(argtypes)
    except Exception as error:  # internals differ from what this module expects
        disable(f"cannot find the compiled kernel: {type(error).__name__}: {error}")
        return
    if compiled is not None:
        _compiled[signature_key(kernel, args)] = (compiled, tuple(argtypes))


def launch(kernel: Any, griddim: tuple, blockdim: int | tuple, stream: Any, args: list[Any]) -> bool:
    """Launches from the cache; False when this signature has not been seen (the caller goes generic)."""
    if not enabled():
        return False
    entry = _compiled.get(signature_key(kernel, args))
    if entry is None:
        return False
    compiled, argtypes = entry
    flat: list[Any] = []
    for arg, argtype in zip(args, argtypes, strict=True):
        if isinstance(arg, int):
            flat.append(getattr(ctypes, f"c_{argtype}")(arg))
        elif isinstance(arg, float):
            flat.append(ctypes.c_double(arg) if str(argtype) == "float64" else ctypes.c_float(arg))
        else:
            itemsize = arg.element_size()
            flat += [0, 0, arg.numel(), itemsize, arg.data_ptr(), *arg.shape, *(s * itemsize for s in arg.stride())]
    launch_fn, config_cls = _launch_api()
    grid = griddim if isinstance(griddim, tuple) else (griddim,)
    block = blockdim if isinstance(blockdim, tuple) else (blockdim,)
    try:
        config = config_cls(grid=grid, block=block, shmem_size=0)
        launch_fn(stream, config, compiled._codelibrary.get_cufunc().kernel, *flat)
    except Exception as error:
        disable(f"{type(error).__name__}: {error}")
        return False
    return True
