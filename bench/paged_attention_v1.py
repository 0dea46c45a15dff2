"""The first CUDA decode-attention kernel, kept only as the GPU benchmark's "before" row.

One block of 128 threads per (query head, sequence): each thread scores one
token by reading its whole K row (neighbouring threads read rows a row apart),
tree reductions in shared memory, and values accumulated one head dimension
per thread over the tile's tokens one after another. A GQA group's K/V is read
once per query head. `kernels.paged_attention_cuda` replaced it.
"""

from __future__ import annotations

import math

import numba
from numba import cuda, float32

THREADS = 128
MAX_HEAD_SIZE = 256
_DIMS_PER_THREAD = MAX_HEAD_SIZE // THREADS


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


def paged_attention_v1(query, key_cache, value_cache, block_tables, context_lens, block_size, scale, out):
    """Launches the old kernel on PyTorch's current stream (CUDA tensors only)."""
    import torch

    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    views = [cuda.as_cuda_array(x, sync=False) for x in (out, query, key_cache, value_cache, block_tables,
                                                          context_lens)]
    _paged_attention_cuda[(query.shape[1], query.shape[0]), THREADS, stream](*views, int(block_size), float(scale))
    return out
