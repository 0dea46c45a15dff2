"""paged_attention_decode: one query token per sequence attending over its paged KV.

Layouts (vLLM's decode interface):

    query:        float32[num_seqs, num_heads, head_size]
    key_cache:    float32[num_blocks, block_size, num_kv_heads, head_size]
    value_cache:  float32[num_blocks, block_size, num_kv_heads, head_size]
    block_tables: int32[num_seqs, max_blocks_per_seq]   physical block of each logical block
    context_lens: int32[num_seqs]                       tokens to attend to, >= 1
    out:          float32[num_seqs, num_heads, head_size]

Token ``t`` of sequence ``s`` lives at
``cache[block_tables[s, t // block_size], t % block_size]``. The context
includes the current token, whose K/V ``write_kv_cache`` has already stored.
Grouped-query attention: query head ``h`` reads KV head
``h // (num_heads // num_kv_heads)``.

    out[s, h] = softmax(scale * q[s, h] · K[s, :ctx]) · V[s, :ctx]

Decode attention reads every cached K/V byte once per step and does two FLOPs
per byte loaded, so it is bound by memory bandwidth; the kernels are written
to read K/V once, contiguously, and never materialize the gathered context.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
from numba import cuda, float32

from kernels.backend import (
    Backend,
    DeviceLaunch,
    all_on_device,
    as_torch,
    cpu_threads_for,
    host_view,
    is_torch_tensor,
    resolve_backend,
)
from kernels.validation import check_array, check_contiguous, check_dim

# CUDA launch shape: one thread block per (head, sequence). Each tile of
# THREADS context tokens is scored one token per thread, then its values are
# accumulated one head dimension per thread (coalesced reads).
THREADS = 128
MAX_HEAD_SIZE = 256
_DIMS_PER_THREAD = MAX_HEAD_SIZE // THREADS

# Reassociation lets LLVM vectorize the dot products and sums; no nnan/ninf,
# because the softmax relies on exp(-inf) == 0 semantics staying honest.
_CPU_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


@cuda.jit
def _paged_attention_cuda(out, query, key_cache, value_cache, block_tables, context_lens, block_size, scale):
    head = cuda.blockIdx.x
    seq = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    num_heads = query.shape[1]
    head_size = query.shape[2]
    kv_head = head // (num_heads // key_cache.shape[2])
    context_len = context_lens[seq]

    q_scaled = cuda.shared.array(MAX_HEAD_SIZE, float32)
    probs = cuda.shared.array(THREADS, float32)
    reduce_buf = cuda.shared.array(THREADS, float32)
    tile_blocks = cuda.shared.array(THREADS, numba.int32)
    tile_offsets = cuda.shared.array(THREADS, numba.int32)
    acc = cuda.local.array(_DIMS_PER_THREAD, float32)

    for dim in range(tid, head_size, THREADS):
        q_scaled[dim] = query[seq, head, dim] * float32(scale)
    for j in range(_DIMS_PER_THREAD):
        acc[j] = float32(0.0)
    # Online softmax: running max and running sum of exp(score - running_max).
    running_max = float32(-math.inf)
    running_sum = float32(0.0)
    cuda.syncthreads()

    for tile_start in range(0, context_len, THREADS):
        token = tile_start + tid
        score = float32(-math.inf)
        if token < context_len:
            logical_block = token // block_size
            block = block_tables[seq, logical_block]
            offset = token - logical_block * block_size
            tile_blocks[tid] = block
            tile_offsets[tid] = offset
            dot = float32(0.0)
            for dim in range(head_size):
                dot += q_scaled[dim] * key_cache[block, offset, kv_head, dim]
            score = dot
        reduce_buf[tid] = score
        cuda.syncthreads()
        stride = THREADS // 2
        while stride > 0:
            if tid < stride:
                other = reduce_buf[tid + stride]
                if other > reduce_buf[tid]:
                    reduce_buf[tid] = other
            cuda.syncthreads()
            stride //= 2
        # Conditionals, not min/max: those builtins failed to compile for the CUDA target (numba 0.68, compile_ptx).
        tile_max = reduce_buf[0]
        new_max = tile_max if tile_max > running_max else running_max
        # First tile: running_max is -inf, so the correction is exp(-inf) = 0.
        correction = math.exp(running_max - new_max)
        prob = float32(0.0)
        if token < context_len:
            prob = math.exp(score - new_max)
        cuda.syncthreads()  # everyone has read reduce_buf[0] before it is reused
        probs[tid] = prob
        reduce_buf[tid] = prob
        cuda.syncthreads()
        stride = THREADS // 2
        while stride > 0:
            if tid < stride:
                reduce_buf[tid] += reduce_buf[tid + stride]
            cuda.syncthreads()
            stride //= 2
        running_sum = running_sum * correction + reduce_buf[0]
        running_max = new_max
        num_valid = context_len - tile_start
        if num_valid > THREADS:
            num_valid = THREADS
        for j in range(_DIMS_PER_THREAD):
            dim = tid + j * THREADS
            if dim < head_size:
                total = acc[j] * correction
                for i in range(num_valid):
                    total += probs[i] * value_cache[tile_blocks[i], tile_offsets[i], kv_head, dim]
                acc[j] = total
        cuda.syncthreads()  # the next tile overwrites probs, tile_blocks, reduce_buf

    inv_sum = float32(1.0) / running_sum
    for j in range(_DIMS_PER_THREAD):
        dim = tid + j * THREADS
        if dim < head_size:
            out[seq, head, dim] = acc[j] * inv_sum


@numba.njit(parallel=True, cache=True, fastmath=_CPU_FASTMATH)
def _paged_attention_cpu(out, query, key_cache, value_cache, block_tables, context_lens, block_size, scale):
    """CPU twin: one (sequence, KV head) per iteration, serving all query heads of its group.

    Each K/V row is loaded once for the whole group. Two passes (scores, then
    values) over a scratch of group * context_len scores: on a CPU that buffer
    sits in cache, so the max-then-sum softmax is cheaper than an online one.
    """
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    for item in numba.prange(num_seqs * num_kv_heads):
        seq = item // num_kv_heads
        kv_head = item - seq * num_kv_heads
        first_head = kv_head * group
        context_len = context_lens[seq]
        num_logical_blocks = (context_len + block_size - 1) // block_size
        q = np.empty((group, head_size), np.float32)
        for g in range(group):
            for dim in range(head_size):
                q[g, dim] = query[seq, first_head + g, dim] * scale
        scores = np.empty((group, context_len), np.float32)
        for logical_block in range(num_logical_blocks):
            block = block_tables[seq, logical_block]
            start = logical_block * block_size
            for offset in range(min(block_size, context_len - start)):
                for g in range(group):
                    dot = np.float32(0.0)
                    for dim in range(head_size):
                        dot += q[g, dim] * key_cache[block, offset, kv_head, dim]
                    scores[g, start + offset] = dot
        inv_sums = np.empty(group, np.float32)
        for g in range(group):
            peak = scores[g, 0]
            for t in range(1, context_len):
                peak = max(peak, scores[g, t])
            total = np.float32(0.0)
            for t in range(context_len):
                p = np.exp(scores[g, t] - peak)
                scores[g, t] = p
                total += p
            inv_sums[g] = np.float32(1.0) / total
        acc = np.zeros((group, head_size), np.float32)
        for logical_block in range(num_logical_blocks):
            block = block_tables[seq, logical_block]
            start = logical_block * block_size
            for offset in range(min(block_size, context_len - start)):
                for g in range(group):
                    p = scores[g, start + offset]
                    for dim in range(head_size):
                        acc[g, dim] += p * value_cache[block, offset, kv_head, dim]
        for g in range(group):
            for dim in range(head_size):
                out[seq, first_head + g, dim] = acc[g, dim] * inv_sums[g]


def paged_attention_decode_reference(query, key_cache, value_cache, block_tables, context_lens, block_size, scale):
    """PyTorch reference, gather-then-dense: per sequence, gather its K/V by block table, then matmul/softmax."""
    import torch

    q_all, key_cache_t, value_cache_t = as_torch(query), as_torch(key_cache), as_torch(value_cache)
    tables = as_torch(block_tables).long()
    num_seqs, num_heads, head_size = q_all.shape
    num_kv_heads = key_cache_t.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q_all)
    for seq, context_len in enumerate(as_torch(context_lens).tolist()):
        blocks = tables[seq, : (context_len + block_size - 1) // block_size]
        keys = key_cache_t[blocks].reshape(-1, num_kv_heads, head_size)[:context_len]  # [ctx, kv, d]
        values = value_cache_t[blocks].reshape(-1, num_kv_heads, head_size)[:context_len]
        q = q_all[seq].reshape(num_kv_heads, group, head_size)
        scores = torch.bmm(q, keys.permute(1, 2, 0)) * scale  # [kv, group, ctx]
        probs = torch.softmax(scores, dim=-1)
        out[seq] = torch.bmm(probs, values.permute(1, 0, 2)).reshape(num_heads, head_size)
    return out


def paged_attention_decode(
    query: Any,
    key_cache: Any,
    value_cache: Any,
    block_tables: Any,
    context_lens: Any,
    block_size: int,
    scale: float,
    out: Any = None,
    backend: str | Backend | None = None,
):
    """Decode attention over paged KV; returns ``out`` (allocated like ``query`` when None).

    Layouts are in the module docstring. Arrays are numpy, PyTorch (CPU or
    CUDA) or Numba device arrays, all on the host or all on the GPU. On host
    arrays the context lengths and the block-table entries they reach are
    checked (ValueError); on GPU arrays that check would synchronize and is
    skipped.
    """
    num_seqs, num_heads, head_size = check_array(
        "query", query, dtypes=("float32",), layout=("num_seqs", "num_heads", "head_size")
    )
    cache_layout = ("num_blocks", "block_size", "num_kv_heads", "head_size")
    cache_shape = check_array("key_cache", key_cache, dtypes=("float32",), layout=cache_layout)
    value_cache_shape = check_array("value_cache", value_cache, dtypes=("float32",), layout=cache_layout)
    if value_cache_shape != cache_shape:
        raise ValueError(f"value_cache has shape {value_cache_shape} but key_cache has shape {cache_shape}")
    num_blocks, cache_block_size, num_kv_heads, _ = cache_shape
    check_dim("key_cache", "head_size", cache_shape[3], head_size, "query")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if int(block_size) != cache_block_size:
        raise ValueError(f"block_size is {block_size} but key_cache has block_size {cache_block_size}")
    tables_shape = check_array("block_tables", block_tables, dtypes=("int32",), layout=("num_seqs", "max_blocks_per_seq"))
    check_dim("block_tables", "num_seqs", tables_shape[0], num_seqs, "query")
    (num_lens,) = check_array("context_lens", context_lens, dtypes=("int32",), layout=("num_seqs",))
    check_dim("context_lens", "num_seqs", num_lens, num_seqs, "query")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite; got {scale}")
    if out is not None:
        out_shape = check_array("out", out, dtypes=("float32",), layout=("num_seqs", "num_heads", "head_size"))
        if out_shape != (num_seqs, num_heads, head_size):
            raise ValueError(f"out has shape {out_shape} but query has shape {(num_seqs, num_heads, head_size)}")
        check_contiguous("out", out)

    arrays = {"query": query, "key_cache": key_cache, "value_cache": value_cache,
              "block_tables": block_tables, "context_lens": context_lens}
    if out is not None:
        arrays["out"] = out
    on_device = all_on_device(arrays)
    chosen = resolve_backend(backend, prefer_cuda=on_device)
    if not on_device:
        _check_context(host_view(block_tables), host_view(context_lens), block_size, num_blocks)
    if out is None:
        out = _empty_like(query)
    if num_seqs == 0:
        return out

    if chosen is Backend.REFERENCE:
        as_torch(out).copy_(
            paged_attention_decode_reference(query, key_cache, value_cache, block_tables, context_lens,
                                             block_size, scale)
        )
    elif chosen is Backend.CPU:
        if on_device:
            raise ValueError("backend 'cpu' needs host arrays; got GPU arrays")
        context_lens_host = host_view(context_lens)
        kv_bytes = 2 * int(context_lens_host.sum()) * num_kv_heads * head_size * 4
        with cpu_threads_for(kv_bytes):
            _paged_attention_cpu(
                host_view(out),
                np.ascontiguousarray(host_view(query)),
                np.ascontiguousarray(host_view(key_cache)),
                np.ascontiguousarray(host_view(value_cache)),
                np.ascontiguousarray(host_view(block_tables)),
                np.ascontiguousarray(host_view(context_lens)),
                int(block_size),
                np.float32(scale),
            )
    else:
        if head_size > MAX_HEAD_SIZE:
            raise ValueError(f"backend 'cuda' supports head_size <= {MAX_HEAD_SIZE}; got {head_size}")
        launch = DeviceLaunch(list(arrays.values()))
        _paged_attention_cuda[(num_heads, num_seqs), THREADS, launch.stream](
            launch.view(out, is_output=True),
            launch.view(query),
            launch.view(key_cache),
            launch.view(value_cache),
            launch.view(block_tables),
            launch.view(context_lens),
            int(block_size),
            float(scale),
        )
        launch.copy_back()
    return out


def _empty_like(query: Any):
    if is_torch_tensor(query):
        import torch

        return torch.empty_like(query, memory_format=torch.contiguous_format)
    if hasattr(query, "__cuda_array_interface__"):
        return cuda.device_array(tuple(query.shape), dtype=np.float32)
    return np.empty(query.shape, np.float32)


def _check_context(block_tables: np.ndarray, context_lens: np.ndarray, block_size: int, num_blocks: int) -> None:
    max_context = block_tables.shape[1] * block_size
    bad_lens = np.flatnonzero((context_lens < 1) | (context_lens > max_context))
    if bad_lens.size:
        seq = int(bad_lens[0])
        raise ValueError(
            f"context_lens[{seq}] is {int(context_lens[seq])}; it must be in [1, {max_context}] "
            f"(max_blocks_per_seq * block_size)"
        )
    num_used = (context_lens.astype(np.int64) + block_size - 1) // block_size
    used = np.arange(block_tables.shape[1])[None, :] < num_used[:, None]
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bad.any():
        seq, logical_block = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"block_tables[{seq}, {logical_block}] is {int(block_tables[seq, logical_block])}; "
            f"it must be in [0, {num_blocks}) (num_blocks)"
        )
