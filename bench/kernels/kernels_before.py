"""Kernels as they were before issue 19's bandwidth work, kept only so the GPU benchmark can time old and new in one run.

``write_kv_cache_per_element`` is the first ``write_kv_cache`` CUDA kernel: one
thread per 4- or 2-byte element, with the token, head and dim recovered by
integer division in every thread (25% of copy bandwidth on an H200).
"""

from __future__ import annotations

from numba import cuda

THREADS_PER_BLOCK = 256


@cuda.jit
def _write_kv_cache_per_element(key, value, key_cache, value_cache, slot_mapping):
    idx = cuda.grid(1)
    num_tokens, num_kv_heads, head_size = key.shape
    row = num_kv_heads * head_size
    if idx >= num_tokens * row:
        return
    token = idx // row
    slot = slot_mapping[token]
    block_size = key_cache.shape[1]
    if slot < 0 or slot >= key_cache.shape[0] * block_size:
        return
    within = idx - token * row
    head = within // head_size
    dim = within - head * head_size
    block = slot // block_size
    offset = slot - block * block_size
    key_cache[block, offset, head, dim] = key[token, head, dim]
    value_cache[block, offset, head, dim] = value[token, head, dim]


def write_kv_cache_per_element(key, value, key_cache, value_cache, slot_mapping, stream) -> None:
    """Launches the old kernel on ``stream`` (Numba's view of PyTorch's current stream)."""
    num_threads = key.numel()
    grid = -(-num_threads // THREADS_PER_BLOCK)
    _write_kv_cache_per_element[grid, THREADS_PER_BLOCK, stream](
        *(cuda.as_cuda_array(t) for t in (key, value, key_cache, value_cache, slot_mapping)))
