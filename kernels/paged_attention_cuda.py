"""The CUDA decode-attention kernels: one thread block per (sequence, KV head, context partition).

Decode attention moves every cached K/V byte once per step and does about one
FLOP per byte, so the design is about bytes and parallelism:

* **One block serves a whole GQA group.** Each K/V row is loaded once for all
  ``group`` query heads that share its KV head (a block per query head would
  read it ``group`` times).
* **Lanes split a row.** Eight lanes score one token, each loading every 8th
  element of its K row (neighbouring lanes, neighbouring addresses), and sum
  their partial dot products with warp shuffles. A 128-thread block scores 16
  tokens at once; the loads of a lane are independent and the head size is a
  compile-time constant, so the compiler issues them back to back.
* **Online softmax per tile.** A tile of TILE tokens is scored into shared
  memory; each warp takes one query head's max and sum; values are then
  accumulated with threads along the head dimension (coalesced rows) and, for
  head sizes under 128, several token subsets per block, merged at the end.
* **Split context (flash-decoding).** With few sequences × KV heads the grid
  would not fill the GPU (tinylm: 64 sequences × 2 KV heads = 128 blocks on a
  132-multiprocessor H100), so the context is cut into partitions of
  ``partition_size`` tokens, each block writes an unnormalised partial result
  with its max and sum, and a second kernel merges them. One partition means
  one launch that writes the output directly.
* **A sliding window moves the partitions, not the grid's shape.** The
  window (``sliding_window``, a launch argument, so one kernel serves every
  window) starts each sequence's partitions at its first token,
  ``max(0, context_len - window)``: partition ``p`` covers ``window start +
  [p, p + 1) * partition_size``, the grid spans ``min(window, longest
  context)`` tokens, and no block is launched for tokens before any window
  (a 4k window on a 32k context launches partitions for 4k tokens, not 32k).
  A partition past its sequence's last token writes nothing and the merge
  reads only the partitions its sequence has, as without a window.
* **The score cap is compiled in.** ``softcap`` (Gemma 2) is a constant of
  the kernel: ``softcap * tanh(score / softcap)`` on each summed score,
  nothing at all when it is 0.

K/V may be float32 or float16 (loads are widened to float32; accumulation is
float32). Under ``NUMBA_ENABLE_CUDASIM=1`` the simulator has no warp shuffles,
so the same reductions run through shared memory and barriers there; every
reduction is reached by all threads of a block, which both versions need.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32
from numba.core.types import float16

from kernels.element_formats import narrower
from kernels.lane_shuffles import SIMULATED, max_lanes, sum_lanes

THREADS = 128
WARP = 32
NUM_WARPS = THREADS // WARP
LANES_PER_TOKEN = 8
TOKENS_AT_ONCE = THREADS // LANES_PER_TOKEN
MAX_HEAD_SIZE = 256
MAX_GROUP = 16
# Tokens scored per tile. The simulator pays per barrier, and barriers grow
# with tokens, so its tests use a small tile to cross tile boundaries cheaply.
DEFAULT_TILE = 32 if SIMULATED else 128


@cuda.jit(device=True, inline=True)
def capped_score(score, softcap, inv_softcap):
    """``softcap * tanh(score / softcap)``, compiled without fast math even inside a fast-math kernel: there
    ``math.tanh`` becomes ``tanh.approx.f32`` (11 bits), a logit error of up to ``softcap * 5e-4``."""
    return softcap * math.tanh(score * inv_softcap)


@functools.cache
def attention_kernels(head_size: int, group: int, dtype: str = "float32", tile: int = DEFAULT_TILE,
                      softcap: float = 0.0):
    """(partition kernel, merge kernel) for one head size, GQA group, K/V dtype and score cap (0: none), all
    compile-time constants.

    K and V rows are loaded into registers of their own dtype and widened only when used: a
    float16 widening is an inline-asm `cvt` that the compiler keeps in order, so widening at the
    load would serialise the loads that are meant to be in flight together.
    """
    storage = {"float32": float32, "float16": float16}[dtype]
    if not 1 <= head_size <= MAX_HEAD_SIZE:
        raise ValueError(f"head_size must be in [1, {MAX_HEAD_SIZE}] for the CUDA kernel; got {head_size}")
    if not 1 <= group <= MAX_GROUP:
        raise ValueError(f"num_heads // num_kv_heads must be in [1, {MAX_GROUP}] for the CUDA kernel; got {group}")
    if tile % WARP or tile % TOKENS_AT_ONCE:
        raise ValueError(f"tile must be a multiple of {WARP}; got {tile}")
    dims_per_lane = -(-head_size // LANES_PER_TOKEN)
    if head_size <= THREADS:
        value_splits, dims_per_thread, value_width = THREADS // head_size, 1, head_size
    else:
        value_splits, dims_per_thread, value_width = 1, -(-head_size // THREADS), THREADS
    q_size = group * head_size
    # Loads in flight per thread: ~32 registers' worth of K per lane, 16 V rows (8 for two dims each);
    # rounds of 16 tokens per tile must divide evenly.
    rounds = tile // TOKENS_AT_ONCE
    keys_in_flight = 1
    while keys_in_flight * 2 <= rounds and keys_in_flight * 2 * dims_per_lane <= 32 and rounds % (keys_in_flight * 2) == 0:
        keys_in_flight *= 2
    values_in_flight = 16 // dims_per_thread
    scores_size = group * tile
    merge_size = group * THREADS
    neg_inf = np.float32(-np.inf)
    capped = softcap > 0
    cap, inv_cap = np.float32(softcap), np.float32(1.0 / softcap if capped else 0.0)

    @cuda.jit
    def partition_kernel(out, part_max, part_sum, part_out, query, key_cache, value_cache, block_tables,
                         context_lens, block_size, scale, part_len, sliding_window):
        kv_head = cuda.blockIdx.x
        seq = cuda.blockIdx.y
        part = cuda.blockIdx.z
        num_parts = cuda.gridDim.z
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        context_len = context_lens[seq]
        first = 0  # the window's first token
        if sliding_window > 0 and context_len > sliding_window:
            first = context_len - sliding_window
        part_start = first + part * part_len
        if part_start >= context_len:
            return  # the whole block leaves together: no barrier is skipped by some threads only
        part_end = part_start + part_len
        if part_end > context_len:
            part_end = context_len

        q = cuda.shared.array(q_size, float32)
        scores = cuda.shared.array(scores_size, float32)
        tile_blocks = cuda.shared.array(tile, int32)
        tile_offsets = cuda.shared.array(tile, int32)
        running_max = cuda.shared.array(group, float32)
        running_sum = cuda.shared.array(group, float32)
        correction = cuda.shared.array(group, float32)
        scratch = cuda.shared.array(merge_size, float32)
        acc = cuda.local.array((group, dims_per_thread), float32)
        keys = cuda.local.array((keys_in_flight, dims_per_lane), storage)
        values = cuda.local.array((values_in_flight, dims_per_thread), storage)

        first_head = kv_head * group
        for i in range(tid, q_size, THREADS):
            g = i // head_size
            q[i] = float32(query[seq, first_head + g, i - g * head_size]) * float32(scale)
        if tid < group:
            running_max[tid] = neg_inf
            running_sum[tid] = float32(0.0)
        for g in range(group):
            for j in range(dims_per_thread):
                acc[g, j] = float32(0.0)
        token_slot = tid // LANES_PER_TOKEN
        sub = tid % LANES_PER_TOKEN
        value_split = tid // value_width
        value_dim = tid - value_split * value_width
        cuda.syncthreads()

        for tile_start in range(part_start, part_end, tile):
            num_valid = part_end - tile_start
            # 1. Scores: 8 lanes per token, 16 tokens at a time, `keys_in_flight` such rounds loaded
            #    before any is used (independent loads in flight hide the memory latency).
            for t0 in range(token_slot, tile, TOKENS_AT_ONCE * keys_in_flight):
                for u in range(keys_in_flight):
                    t = t0 + u * TOKENS_AT_ONCE
                    for k in range(dims_per_lane):
                        keys[u, k] = storage(0.0)
                    if t < num_valid:
                        token = tile_start + t
                        logical_block = token // block_size
                        block = block_tables[seq, logical_block]
                        offset = token - logical_block * block_size
                        if sub == 0:
                            tile_blocks[t] = block
                            tile_offsets[t] = offset
                        for k in range(dims_per_lane):
                            dim = sub + k * LANES_PER_TOKEN
                            if dim < head_size:
                                keys[u, k] = key_cache[block, offset, kv_head, dim]
                for u in range(keys_in_flight):
                    t = t0 + u * TOKENS_AT_ONCE
                    for g in range(group):
                        dot = float32(0.0)
                        for k in range(dims_per_lane):
                            dim = sub + k * LANES_PER_TOKEN
                            if dim < head_size:
                                dot += q[g * head_size + dim] * float32(keys[u, k])
                        dot = sum_lanes(dot, LANES_PER_TOKEN, scratch, tid)
                        if capped:
                            dot = capped_score(dot, cap, inv_cap)
                        if sub == 0:
                            scores[g * tile + t] = dot if t < num_valid else neg_inf
            cuda.syncthreads()
            # 2. Softmax bookkeeping: one warp per query head.
            for g0 in range(0, group, NUM_WARPS):
                g = g0 + warp
                tile_max = neg_inf
                if g < group:
                    for t in range(lane, tile, WARP):
                        if scores[g * tile + t] > tile_max:
                            tile_max = scores[g * tile + t]
                tile_max = max_lanes(tile_max, WARP, scratch, tid)
                total = float32(0.0)
                new_max = neg_inf
                if g < group:
                    old_max = running_max[g]
                    new_max = tile_max if tile_max > old_max else old_max
                    for t in range(lane, tile, WARP):
                        p = math.exp(scores[g * tile + t] - new_max)  # exp(-inf) = 0 for padding
                        scores[g * tile + t] = p
                        total += p
                total = sum_lanes(total, WARP, scratch, tid)
                if g < group and lane == 0:
                    scale_old = math.exp(running_max[g] - new_max)  # 0 on the first tile
                    correction[g] = scale_old
                    running_sum[g] = running_sum[g] * scale_old + total
                    running_max[g] = new_max
            cuda.syncthreads()
            # 3. Values: threads along the head dimension, `value_splits` token subsets.
            for g in range(group):
                for j in range(dims_per_thread):
                    acc[g, j] *= correction[g]
            if value_split < value_splits:
                limit = num_valid if num_valid < tile else tile
                for t0 in range(value_split, limit, value_splits * values_in_flight):
                    for u in range(values_in_flight):  # loads first, all in flight together
                        t = t0 + u * value_splits
                        for j in range(dims_per_thread):
                            values[u, j] = storage(0.0)
                        if t < limit:
                            block = tile_blocks[t]
                            offset = tile_offsets[t]
                            for j in range(dims_per_thread):
                                dim = value_dim + j * THREADS
                                if dim < head_size:
                                    values[u, j] = value_cache[block, offset, kv_head, dim]
                    for u in range(values_in_flight):
                        t = t0 + u * value_splits
                        if t < limit:
                            for j in range(dims_per_thread):
                                v = float32(values[u, j])
                                for g in range(group):
                                    acc[g, j] += scores[g * tile + t] * v
            cuda.syncthreads()  # the next tile overwrites scores and the tile's rows

        # Merge the token subsets (same max within the block, so plain sums).
        if value_splits > 1:
            for g in range(group):
                scratch[g * THREADS + tid] = acc[g, 0] if value_split < value_splits else float32(0.0)
            cuda.syncthreads()
        if tid < value_width:
            for g in range(group):
                for j in range(dims_per_thread):
                    dim = tid + j * THREADS
                    if dim < head_size:
                        total = acc[g, j]
                        if value_splits > 1:
                            total = float32(0.0)
                            for s in range(value_splits):
                                total += scratch[g * THREADS + s * value_width + tid]
                        if num_parts == 1:
                            out[seq, first_head + g, dim] = total / running_sum[g]
                        else:
                            part_out[seq, first_head + g, part, dim] = total
        if num_parts > 1 and tid < group:
            part_max[seq, first_head + tid, part] = running_max[tid]
            part_sum[seq, first_head + tid, part] = running_sum[tid]

    return partition_kernel, merge_kernel(head_size, dtype)


@functools.cache
def merge_kernel(head_size: int, dtype: str = "float32"):
    """The kernel merging split-context partitions into ``out`` (of element format ``dtype``, bfloat16 as int16)."""
    narrow = narrower(dtype)
    neg_inf = np.float32(-np.inf)

    @cuda.jit
    def merge(out, part_max, part_sum, part_out, context_lens, part_len, sliding_window):
        head = cuda.blockIdx.x
        seq = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        span = context_lens[seq]  # tokens attended to, from the window's first
        if sliding_window > 0 and span > sliding_window:
            span = sliding_window
        num_parts = (span + part_len - 1) // part_len
        best = neg_inf
        for p in range(num_parts):
            if part_max[seq, head, p] > best:
                best = part_max[seq, head, p]
        total = float32(0.0)
        for p in range(num_parts):
            total += part_sum[seq, head, p] * math.exp(part_max[seq, head, p] - best)
        inv_total = float32(1.0) / total
        for dim in range(tid, head_size, THREADS):
            value = float32(0.0)
            for p in range(num_parts):
                value += part_out[seq, head, p, dim] * math.exp(part_max[seq, head, p] - best)
            out[seq, head, dim] = narrow(value * inv_total)

    return merge


def partition_length(max_context: int, num_blocks_in_grid: int, target_blocks: int, tile: int = DEFAULT_TILE) -> int:
    """Tokens per partition: enough partitions that the grid reaches `target_blocks`, none shorter than 2 tiles.

    `num_blocks_in_grid` is sequences × KV heads; when it reaches the target
    alone, the whole context is one partition (one launch, no merge).
    `max_context` is the most tokens a sequence attends to: with a sliding
    window, the window when it is shorter than the table.
    """
    if num_blocks_in_grid >= target_blocks or max_context <= 2 * tile:
        return max_context
    wanted = -(-target_blocks // num_blocks_in_grid)
    length = -(-max_context // wanted)
    length = max(2 * tile, -(-length // tile) * tile)
    return min(length, max_context)
