"""write_kv_cache: scatter one step's new keys and values into paged KV blocks.

Layouts (vLLM's, minus its x-packing of keys):

    key, value:             float32[num_tokens, num_kv_heads, head_size]   (or float16, all four alike)
    key_cache, value_cache: float32[num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping:           int64[num_tokens]

Token ``t`` goes to block ``slot // block_size``, row ``slot % block_size``.
A negative slot marks a padding token, which is skipped. Slots must be
distinct; two tokens aimed at one slot leave either value there.

The op is one copy of ``num_tokens * num_kv_heads * head_size`` floats per
cache, so every backend is bound by memory traffic.
"""

from __future__ import annotations

import functools
from typing import Any

import numba
import numpy as np
from numba import cuda

from kernels.backend import (
    Backend,
    DeviceLaunch,
    all_on_device,
    as_torch,
    cpu_threads_for,
    dtype_name,
    host_view,
    is_on_device,
    is_torch_tensor,
    resolve_backend,
)
from kernels.element_formats import FORMATS, as_kernel_array, format_itemsize
from kernels.validation import check_array, check_contiguous, check_dim
from kernels.vector_access import start_alignment, vector_copier, widest_access

THREADS_PER_BLOCK = 256
# Chunks each thread copies, THREADS_PER_BLOCK apart so that every pass of a
# warp covers 32 neighbouring chunks. A copy is a load and the store that needs
# it, so a thread has one load in flight; full occupancy (the kernel uses ~24
# registers) supplies the rest, and the loop amortises the index setup.
CHUNKS_PER_THREAD = 4
CHUNKS_PER_BLOCK = THREADS_PER_BLOCK * CHUNKS_PER_THREAD


@functools.cache
def _scatter_kernel(row_bytes: int, width: int, itemsize: int):
    """The kernel copying ``row_bytes``-byte token rows as ``width``-byte chunks, all compile-time constants.

    Rows are contiguous in key/value and in a cache slot, so the op is a copy
    of ``num_tokens * chunks_per_row`` chunks: chunk ``i`` of the flattened
    key is chunk ``i % chunks_per_row`` of token ``i // chunks_per_row``'s row.
    Consecutive threads take consecutive chunks, so a warp moves 32
    neighbouring chunks (512 bytes at width 16) of one or two rows. The
    constant divisor becomes a multiply and shift, not a 64-bit division.
    """
    copy = vector_copier(width)
    chunk_elements = width // itemsize
    chunks_per_row = row_bytes // width
    row_elements = row_bytes // itemsize

    @cuda.jit
    def scatter(key, value, key_cache, value_cache, slot_mapping):
        num_chunks = slot_mapping.shape[0] * chunks_per_row
        num_slots = key_cache.shape[0] * key_cache.shape[1]
        first = cuda.blockIdx.x * CHUNKS_PER_BLOCK + cuda.threadIdx.x
        for step in range(CHUNKS_PER_THREAD):
            chunk = first + step * THREADS_PER_BLOCK
            if chunk < num_chunks:
                token = chunk // chunks_per_row
                slot = slot_mapping[token]
                # Device-resident slots are not range-checked on the host (that
                # would synchronize); an out-of-range slot is dropped rather
                # than written wild, and a negative one is padding.
                if 0 <= slot < num_slots:
                    src = chunk * chunk_elements
                    dst = slot * row_elements + (chunk - token * chunks_per_row) * chunk_elements
                    copy(key_cache, dst, key, src)
                    copy(value_cache, dst, value, src)

    return scatter


@numba.njit(parallel=True, cache=True)
def _write_kv_cache_cpu(key, value, key_cache, value_cache, slot_mapping):
    """CPU twin: one token per iteration; each token's rows are contiguous in both tensors."""
    num_tokens, num_kv_heads, head_size = key.shape
    block_size = key_cache.shape[1]
    for token in numba.prange(num_tokens):
        slot = slot_mapping[token]
        if slot < 0:
            continue
        block = slot // block_size
        offset = slot - block * block_size
        for head in range(num_kv_heads):
            for dim in range(head_size):
                key_cache[block, offset, head, dim] = key[token, head, dim]
                value_cache[block, offset, head, dim] = value[token, head, dim]


def write_kv_cache_reference(key, value, key_cache, value_cache, slot_mapping) -> None:
    """PyTorch reference: index_copy_ into the caches viewed as [num_slots, num_kv_heads, head_size]."""
    key_t, value_t = as_torch(key), as_torch(value)
    key_cache_t, value_cache_t = as_torch(key_cache), as_torch(value_cache)
    slots = as_torch(slot_mapping)
    keep = slots >= 0
    kept_slots = slots[keep]
    num_kv_heads, head_size = key_cache_t.shape[2], key_cache_t.shape[3]
    key_cache_t.view(-1, num_kv_heads, head_size).index_copy_(0, kept_slots, key_t[keep])
    value_cache_t.view(-1, num_kv_heads, head_size).index_copy_(0, kept_slots, value_t[keep])


def write_kv_cache(
    key: Any,
    value: Any,
    key_cache: Any,
    value_cache: Any,
    slot_mapping: Any,
    backend: str | Backend | None = None,
) -> None:
    """Writes ``key``/``value`` into ``key_cache``/``value_cache`` in place at ``slot_mapping``.

    Layouts are in the module docstring. Arrays are numpy, PyTorch (CPU or
    CUDA) or Numba device arrays, all on the host or all on the GPU. The caches
    must be C-contiguous. On host arrays every slot is checked against the
    cache's capacity (ValueError); on GPU arrays an out-of-range slot is skipped.
    """
    num_tokens, num_kv_heads, head_size = check_array(
        "key", key, dtypes=FORMATS, layout=("num_tokens", "num_kv_heads", "head_size")
    )
    dtype = dtype_name(key)
    value_shape = check_array("value", value, dtypes=(dtype,), layout=("num_tokens", "num_kv_heads", "head_size"))
    if value_shape != (num_tokens, num_kv_heads, head_size):
        raise ValueError(f"value has shape {value_shape} but key has shape {(num_tokens, num_kv_heads, head_size)}")
    cache_layout = ("num_blocks", "block_size", "num_kv_heads", "head_size")
    cache_shape = check_array("key_cache", key_cache, dtypes=(dtype,), layout=cache_layout)
    value_cache_shape = check_array("value_cache", value_cache, dtypes=(dtype,), layout=cache_layout)
    if value_cache_shape != cache_shape:
        raise ValueError(f"value_cache has shape {value_cache_shape} but key_cache has shape {cache_shape}")
    check_dim("key_cache", "num_kv_heads", cache_shape[2], num_kv_heads, "key")
    check_dim("key_cache", "head_size", cache_shape[3], head_size, "key")
    (num_slots_given,) = check_array("slot_mapping", slot_mapping, dtypes=("int64",), layout=("num_tokens",))
    check_dim("slot_mapping", "num_tokens", num_slots_given, num_tokens, "key")
    check_contiguous("key_cache", key_cache)
    check_contiguous("value_cache", value_cache)

    # A pure copy: bfloat16 (which neither numpy nor Numba has) travels as its int16 bits.
    key, value, key_cache, value_cache = (as_kernel_array(x) for x in (key, value, key_cache, value_cache))
    arrays = {"key": key, "value": value, "key_cache": key_cache, "value_cache": value_cache,
              "slot_mapping": slot_mapping}
    on_device = all_on_device(arrays)
    chosen = resolve_backend(backend, prefer_cuda=on_device)
    if not on_device:
        _check_slots(host_view(slot_mapping), num_slots=cache_shape[0] * cache_shape[1])
    if num_tokens == 0:
        return
    if chosen is Backend.REFERENCE:
        write_kv_cache_reference(key, value, key_cache, value_cache, slot_mapping)
    elif chosen is Backend.CPU:
        if on_device:
            raise ValueError("backend 'cpu' needs host arrays; got GPU arrays")
        # A pure copy: 16-bit formats travel as their bits (numba's CPU target has no float16).
        bits = np.uint16 if format_itemsize(dtype) == 2 else np.float32
        write_kv_cache_host(
            np.ascontiguousarray(host_view(key)).view(bits),
            np.ascontiguousarray(host_view(value)).view(bits),
            host_view(key_cache).view(bits),
            host_view(value_cache).view(bits),
            np.ascontiguousarray(host_view(slot_mapping)),
        )
    else:
        _scatter_on_device(key, value, key_cache, value_cache, slot_mapping, itemsize=format_itemsize(dtype))


def write_kv_cache_host(key: np.ndarray, value: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray,
                        slot_mapping: np.ndarray) -> None:
    """The CPU twin on arrays the caller has checked: C-contiguous numpy arrays of one dtype in the
    layouts above (float16 viewed as uint16), int64 slots below the caches' capacity (what
    ``write_kv_cache`` checks). Nothing is checked here; a slot out of range writes outside the
    caches. For a model that checks its step once and writes in every layer."""
    with cpu_threads_for(4 * key.size * key.itemsize):
        _write_kv_cache_cpu(key, value, key_cache, value_cache, slot_mapping)


def _scatter_on_device(key, value, key_cache, value_cache, slot_mapping, *, itemsize: int) -> None:
    key, value = _c_contiguous(key), _c_contiguous(value)
    num_tokens, num_kv_heads, head_size = (int(n) for n in key.shape)
    row_bytes = num_kv_heads * head_size * itemsize
    width = _access_width([key, value, key_cache, value_cache], row_bytes, itemsize=itemsize)
    num_blocks = -(-num_tokens * (row_bytes // width) // CHUNKS_PER_BLOCK)
    args = [key, value, key_cache, value_cache, slot_mapping]
    DeviceLaunch(args).launch(_scatter_kernel(row_bytes, width, itemsize), num_blocks, THREADS_PER_BLOCK, args,
                              outputs=(2, 3))


def _c_contiguous(x: Any) -> Any:
    """``x`` as the kernel's flat indexing needs it: C-contiguous (no copy when it already is).

    Host arrays are left alone: DeviceLaunch copies them in contiguous.
    """
    if is_torch_tensor(x):
        return x.contiguous()
    if is_on_device(x):
        tensor = as_torch(x)
        return x if tensor.is_contiguous() else tensor.contiguous()
    return x


def _access_width(tensors: list[Any], row_bytes: int, *, itemsize: int) -> int:
    """The widest access that tiles a row and that every tensor's start is aligned to; else one element."""
    width = widest_access(row_bytes, itemsize=itemsize)
    if all(start_alignment(t) >= width for t in tensors):
        return width
    return itemsize


def _check_slots(slots: np.ndarray, *, num_slots: int) -> None:
    bad = np.flatnonzero(slots >= num_slots)
    if bad.size:
        token = int(bad[0])
        raise ValueError(
            f"slot_mapping[{token}] is {int(slots[token])} but the cache holds only {num_slots} slots "
            f"(num_blocks * block_size)"
        )
