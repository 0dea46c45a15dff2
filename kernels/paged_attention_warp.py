"""The CUDA decode-attention kernel for bandwidth: every warp streams its own tokens, 16 bytes a load.

The first kernel (``kernels.paged_attention_cuda``) scored a tile of tokens
into shared memory, then ran the softmax and the values as block-wide phases
with three barriers per tile and 2- or 4-byte loads. On an H200 it reached at
most 16% of the copy bandwidth: the number of load instructions and the
barriers bound it, not bytes (docs/kernels.md). This one is built like a
streaming copy:

* **Lane groups own tokens.** ``L`` lanes (a power of two) share one token; a
  warp holds ``32 / L`` tokens at a time and each of the 4 warps of a block
  walks its own tokens of the partition. A lane loads the same ``16``-byte
  pieces of the token's K row and of its V row (one ``ld.global.v4`` each),
  so one instruction of the ``L`` lanes reads ``16·L`` contiguous bytes.
* **No barrier in the loop.** The ``L`` lanes sum their partial dot products
  with warp shuffles, so each of them holds the token's score, and then fold
  the token into their own online softmax (running max, sum and the weighted
  V of their dims). ``U`` tokens per lane group are loaded (K and V) before
  any is used, so loads are in flight together.
* **Merges at the end only.** The lane groups of a warp merge by shuffles,
  the warps through shared memory, and split partitions by the merge kernel
  of ``kernels.paged_attention_cuda`` (flash-decoding), as before; a sliding
  window moves each sequence's partitions to start at its first token, and
  a score cap is compiled in, as there.
* **Registers bound the shape.** The query slice (``group`` heads × the lane's
  dims) and the accumulators live in registers, so ``L`` grows with
  ``group × head_size`` and a large GQA group is split over blocks
  (``heads_per_block``), each reading the K/V of its KV head once.

* **16-bit formats may stay packed** (``WarpLayout.packed``): float16 and
  bfloat16 K/V words are held two elements to a register while in flight and
  widened when folded, once per token for all of the block's query heads, so
  twice the tokens fit in flight in the same registers. bfloat16 (int16 bits)
  widens by a shift.

``layout_for`` picks the access width and ``L`` at launch time: 16-byte
loads where the row's bytes and the cache's address allow it, narrower
otherwise, so every head size and alignment runs. Under
``NUMBA_ENABLE_CUDASIM=1`` shuffles are emulated through shared memory and
barriers (``kernels.lane_shuffles``), which every thread of the block reaches.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import numpy as np
from numba import cuda, float32, int32, uint32

from kernels.element_formats import format_itemsize, narrower, widener
from kernels.lane_shuffles import SIMULATED, sum_lanes, xor_lane
from kernels.paged_attention_cuda import capped_score
from kernels.vector_access import ACCESS_WIDTHS, pair_unpacker, vector_loader, word_loader

WARP = 32
# Four warps a block on a GPU. The simulator runs every thread in Python and every emulated shuffle is
# a block barrier, so it runs two: the warp merge still has more than one warp to merge, at half the cost.
NUM_WARPS = 2 if SIMULATED else 4
THREADS = NUM_WARPS * WARP
# Query and accumulator floats a lane keeps per block (each): more spills registers.
MAX_LANE_FLOATS = 64
# Bytes the lanes of one token read per load instruction, at least (two 32-byte sectors).
MIN_BYTES_PER_TOKEN_LOAD = 64
# Widened K and V floats a lane holds for the tokens in flight.
MAX_FLOATS_IN_FLIGHT = 64
MAX_TOKENS_IN_FLIGHT = 4
# Packed 16-bit K/V take half the registers per token, so twice the tokens may be in flight.
MAX_PACKED_TOKENS_IN_FLIGHT = 8


@dataclass(frozen=True)
class WarpLayout:
    """How a block splits the work; every field is a compile-time constant of the kernel."""

    width: int  # bytes per load
    lanes_per_token: int  # L: lanes sharing one token (power of two)
    heads_per_block: int  # query heads of the GQA group this block serves
    tokens_in_flight: int  # U: tokens a lane group loads before using any
    prefetch: bool = False  # load the next step's K/V before folding this step's (twice the K/V registers)
    packed: bool = False  # 16-bit K/V held two to a register until folded (float16/bfloat16, loads >= 4 bytes)
    fastmath: bool = False  # approximate exp, contracted and reassociated float math (LLVM fast-math flags)

    def elements_per_load(self, itemsize: int) -> int:
        return self.width // itemsize

    def check(self, head_size: int, group: int, itemsize: int) -> None:
        """ValueError unless this layout can serve the shape (for layouts given by hand, e.g. when tuning)."""
        row_bytes = head_size * itemsize
        problems = []
        if self.width not in ACCESS_WIDTHS or self.width < itemsize or row_bytes % self.width:
            problems.append(f"width {self.width} does not tile a {row_bytes}-byte row")
        elif (row_bytes // self.width) % self.lanes_per_token:
            problems.append(f"{self.lanes_per_token} lanes do not split {row_bytes // self.width} loads per row")
        if self.lanes_per_token not in (1, 2, 4, 8, 16, 32):
            problems.append(f"lanes_per_token must be a power of two <= 32; got {self.lanes_per_token}")
        if group % self.heads_per_block:
            problems.append(f"heads_per_block {self.heads_per_block} does not divide the group of {group}")
        if not 1 <= self.tokens_in_flight <= 16:
            problems.append(f"tokens_in_flight must be in [1, 16]; got {self.tokens_in_flight}")
        if self.packed and (itemsize != 2 or self.width < 4):
            problems.append(f"packed needs 2-byte elements and loads of >= 4 bytes; got {itemsize}-byte elements, "
                            f"width {self.width}")
        if problems:
            raise ValueError("warp layout: " + "; ".join(problems))


def layout_for(head_size: int, group: int, itemsize: int, max_width: int = 16,
               lane_floats: int = MAX_LANE_FLOATS, packed: bool | None = None) -> WarpLayout:
    """The widest loads, then the fewest lanes per token, that keep a lane's registers within bounds.

    ``max_width`` is the largest access the cache's address alignment allows;
    ``lane_floats`` bounds the query (and accumulator) floats a lane holds.
    Fewer lanes per token mean fewer shuffles; at least enough lanes that one
    load instruction reads ``MIN_BYTES_PER_TOKEN_LOAD`` of the row, where the
    row allows it.

    16-bit elements loaded 4 or more bytes at a time: by default (``packed``
    None) kept packed, the next step prefetched, with fast math, the fastest
    layout of every shape on an H200 (docs/kernels.md: 1.35-1.45x the plain
    one); ``packed=False`` gives the plain layout, ``packed=True`` packed with
    twice the tokens in flight instead of prefetching. float32 ignores it.
    """
    heads = max(h for h in range(1, group + 1) if group % h == 0 and (h * head_size <= WARP * lane_floats or h == 1))
    for_registers = -(-heads * head_size // lane_floats)
    row_bytes = head_size * itemsize
    for width in sorted((w for w in ACCESS_WIDTHS if itemsize <= w <= max_width), reverse=True):
        if row_bytes % width:
            continue
        num_loads = row_bytes // width
        options = [lanes for lanes in (1, 2, 4, 8, 16, 32) if lanes >= for_registers and num_loads % lanes == 0]
        if options:
            contiguous = [lanes for lanes in options if lanes * width >= min(row_bytes, MIN_BYTES_PER_TOKEN_LOAD)]
            lanes = contiguous[0] if contiguous else options[-1]
            plain = WarpLayout(width, lanes, heads, _tokens_in_flight(head_size // lanes))
            if itemsize != 2 or width < 4 or packed is False:
                return plain
            if packed:
                return replace(plain, tokens_in_flight=_tokens_in_flight(head_size // lanes, packed=True), packed=True)
            # Packed words with a second set for the prefetch take the plain layout's registers at its tokens.
            return replace(plain, packed=True, prefetch=True, fastmath=True)
    lanes = 1  # element-wide loads: the largest power of two that divides the row
    while lanes * 2 <= WARP and head_size % (lanes * 2) == 0:
        lanes *= 2
    return WarpLayout(itemsize, lanes, heads, _tokens_in_flight(head_size // lanes))


def _tokens_in_flight(dims_per_lane: int, packed: bool = False) -> int:
    if packed:  # K and V words: dims_per_lane / 2 registers each
        return max(1, min(MAX_PACKED_TOKENS_IN_FLIGHT, MAX_FLOATS_IN_FLIGHT // dims_per_lane))
    return max(1, min(MAX_TOKENS_IN_FLIGHT, MAX_FLOATS_IN_FLIGHT // (2 * dims_per_lane)))


@functools.cache
def warp_attention_kernel(head_size: int, group: int, dtype: str, layout: WarpLayout, softcap: float = 0.0):
    """The partition kernel for one shape, element format (float32, float16, bfloat16 as int16 bits) and score
    cap (0: none); it writes ``out`` directly when the grid has one partition."""
    itemsize = format_itemsize(dtype)
    vec = layout.elements_per_load(itemsize)
    lanes = layout.lanes_per_token
    heads = layout.heads_per_block
    tokens_in_flight = layout.tokens_in_flight
    loads_per_lane = head_size // (vec * lanes)
    dims = loads_per_lane * vec  # dims a lane owns, for K and V alike
    tokens_per_warp = WARP // lanes
    step = NUM_WARPS * tokens_per_warp * tokens_in_flight
    chunks = group // heads
    packed = layout.packed
    load = word_loader(dtype, vec) if packed else vector_loader(dtype, vec)
    unpack = pair_unpacker(dtype) if packed else None
    words_per_load = vec // 2
    words = dims // 2  # packed K (or V) registers per token
    widen, narrow = widener(dtype), narrower(dtype)
    prefetch = layout.prefetch
    fast = layout.fastmath
    neg_inf = np.float32(-np.inf)
    zero = np.float32(0.0)
    capped = softcap > 0
    cap, inv_cap = np.float32(softcap), np.float32(1.0 / softcap if capped else 0.0)

    # Per load and per token: elements (widened to float32), or uint32 words of two 16-bit elements when packed.
    per_load = words_per_load if packed else vec
    per_token = words if packed else dims
    empty = np.uint32(0) if packed else zero  # +0.0 in every format

    @cuda.jit(device=True, inline=True, fastmath=fast)
    def load_step(keys, values, step_start, part_end, warp, slot, sub, seq, kv_head, block_tables,
                  key_cache, value_cache, rows_per_block, num_kv_heads):
        """K and V of `tokens_in_flight` tokens of this lane group, all loads issued before any use."""
        for u in range(tokens_in_flight):
            token = step_start + (warp * tokens_in_flight + u) * tokens_per_warp + slot
            if token < part_end:
                logical_block = token // rows_per_block
                block = int32(block_tables[seq, logical_block])
                row = ((block * rows_per_block + token - logical_block * rows_per_block) * num_kv_heads
                       + kv_head) * head_size
                for j in range(loads_per_lane):
                    index = row + (sub + j * lanes) * vec
                    k_part = load(key_cache, index)
                    v_part = load(value_cache, index)
                    for e in range(per_load):
                        keys[u, j * per_load + e] = k_part[e]
                        values[u, j * per_load + e] = v_part[e]
            else:
                for d in range(per_token):
                    keys[u, d] = empty
                    values[u, d] = empty

    @cuda.jit(device=True, inline=True, fastmath=fast)
    def fold_step(keys, values, step_start, part_end, warp, slot, q, acc, run_max, run_sum, scores, wide, scratch,
                  tid):
        """The loaded tokens into this lane group's online softmax (every lane of the block calls it); ``wide``
        is the packed fold's scratch, unused here (the K/V are floats already)."""
        # Scores: partial dots summed over the token's lanes.
        for u in range(tokens_in_flight):
            valid = step_start + (warp * tokens_in_flight + u) * tokens_per_warp + slot < part_end
            for g in range(heads):
                dot = zero
                for d in range(dims):
                    dot += q[g, d] * keys[u, d]
                dot = sum_lanes(dot, lanes, scratch, tid)
                if capped:
                    dot = capped_score(dot, cap, inv_cap)
                scores[g, u] = dot if valid else neg_inf
        # Online softmax over the new tokens, and their values into this lane's dims.
        for g in range(heads):
            best = run_max[g]
            for u in range(tokens_in_flight):
                if scores[g, u] > best:
                    best = scores[g, u]
            if best > neg_inf:
                # Rescaling every step was 1-2% faster on an H200 than branching to rescale only when
                # the max grows (bench/kernels/bench_gpu_attention_sweep.py). exp(-inf) = 0 clears the first step's sum.
                rescale = math.exp(run_max[g] - best)
                total = run_sum[g] * rescale
                for d in range(dims):
                    acc[g, d] *= rescale
                for u in range(tokens_in_flight):
                    p = math.exp(scores[g, u] - best)  # 0 for tokens past the end
                    total += p
                    for d in range(dims):
                        acc[g, d] += p * values[u, d]
                run_sum[g] = total
                run_max[g] = best

    @cuda.jit(device=True, inline=True, fastmath=fast)
    def fold_packed_step(keys, values, step_start, part_end, warp, slot, q, acc, run_max, run_sum, scores, wide,
                         scratch, tid):
        """``fold_step`` on packed K/V: each token's words are widened once (into ``wide``) for all heads,
        and the softmax weights of the step are known before its values are folded."""
        for u in range(tokens_in_flight):
            valid = step_start + (warp * tokens_in_flight + u) * tokens_per_warp + slot < part_end
            for w in range(words):
                low, high = unpack(keys[u, w])
                wide[2 * w] = low
                wide[2 * w + 1] = high
            for g in range(heads):
                dot = zero
                for d in range(dims):
                    dot += q[g, d] * wide[d]
                dot = sum_lanes(dot, lanes, scratch, tid)
                if capped:
                    dot = capped_score(dot, cap, inv_cap)
                scores[g, u] = dot if valid else neg_inf
        for g in range(heads):  # scores become this step's weights; the accumulators are rescaled once
            best = run_max[g]
            for u in range(tokens_in_flight):
                if scores[g, u] > best:
                    best = scores[g, u]
            if best > neg_inf:
                rescale = math.exp(run_max[g] - best)
                total = run_sum[g] * rescale
                for d in range(dims):
                    acc[g, d] *= rescale
                for u in range(tokens_in_flight):
                    p = math.exp(scores[g, u] - best)  # 0 for tokens past the end
                    scores[g, u] = p
                    total += p
                run_sum[g] = total
                run_max[g] = best
            else:
                for u in range(tokens_in_flight):
                    scores[g, u] = zero
        for u in range(tokens_in_flight):
            for w in range(words):
                low, high = unpack(values[u, w])
                wide[2 * w] = low
                wide[2 * w + 1] = high
            for g in range(heads):
                p = scores[g, u]
                for d in range(dims):
                    acc[g, d] += p * wide[d]

    # Registers for the K/V in flight: widened floats, or packed words; the fold that reads them.
    register = uint32 if packed else float32
    fold = fold_packed_step if packed else fold_step

    @cuda.jit(device=True, inline=True, fastmath=fast)
    def plain_steps(part_start, part_end, warp, slot, sub, seq, kv_head, block_tables, key_cache,
                    value_cache, rows_per_block, num_kv_heads, q, acc, run_max, run_sum, scores, scratch, tid):
        keys = cuda.local.array((tokens_in_flight, per_token), register)
        values = cuda.local.array((tokens_in_flight, per_token), register)
        wide = cuda.local.array(dims, float32)
        for step_start in range(part_start, part_end, step):
            load_step(keys, values, step_start, part_end, warp, slot, sub, seq, kv_head, block_tables, key_cache,
                      value_cache, rows_per_block, num_kv_heads)
            fold(keys, values, step_start, part_end, warp, slot, q, acc, run_max, run_sum, scores, wide, scratch, tid)

    @cuda.jit(device=True, inline=True, fastmath=fast)
    def prefetched_steps(part_start, part_end, warp, slot, sub, seq, kv_head, block_tables, key_cache, value_cache,
                         rows_per_block, num_kv_heads, q, acc, run_max, run_sum, scores, scratch, tid):
        """The next step's loads go out before this step's arithmetic, in a second set of registers."""
        keys = cuda.local.array((tokens_in_flight, per_token), register)
        values = cuda.local.array((tokens_in_flight, per_token), register)
        next_keys = cuda.local.array((tokens_in_flight, per_token), register)
        next_values = cuda.local.array((tokens_in_flight, per_token), register)
        wide = cuda.local.array(dims, float32)
        load_step(keys, values, part_start, part_end, warp, slot, sub, seq, kv_head, block_tables, key_cache,
                  value_cache, rows_per_block, num_kv_heads)
        for step_start in range(part_start, part_end, 2 * step):
            load_step(next_keys, next_values, step_start + step, part_end, warp, slot, sub, seq, kv_head,
                      block_tables, key_cache, value_cache, rows_per_block, num_kv_heads)
            fold(keys, values, step_start, part_end, warp, slot, q, acc, run_max, run_sum, scores, wide, scratch, tid)
            load_step(keys, values, step_start + 2 * step, part_end, warp, slot, sub, seq, kv_head, block_tables,
                      key_cache, value_cache, rows_per_block, num_kv_heads)
            fold(next_keys, next_values, step_start + step, part_end, warp, slot, q, acc, run_max, run_sum, scores,
                 wide, scratch, tid)

    run_steps = prefetched_steps if prefetch else plain_steps

    @cuda.jit(fastmath=fast)
    def kernel(out, part_max, part_sum, part_out, query, key_cache, value_cache, block_tables, context_lens,
               block_size, scale, part_len, sliding_window):
        kv_head = cuda.blockIdx.x // chunks
        first_head = kv_head * group + (cuda.blockIdx.x - kv_head * chunks) * heads
        seq = cuda.blockIdx.y
        part = cuda.blockIdx.z
        num_parts = cuda.gridDim.z
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        slot = lane // lanes
        sub = lane - slot * lanes
        context_len = int32(context_lens[seq])
        first = int32(0)  # the window's first token
        if sliding_window > 0 and context_len > sliding_window:
            first = int32(context_len - sliding_window)
        part_start = int32(first + part * part_len)
        if part_start >= context_len:
            return  # the whole block leaves together: no barrier is skipped by some threads only
        part_end = part_start + int32(part_len)
        if part_end > context_len:
            part_end = context_len
        rows_per_block = int32(block_size)
        num_kv_heads = int32(key_cache.shape[2])

        scratch = cuda.shared.array(THREADS, float32)  # the simulator's shuffles
        merge_max = cuda.shared.array((NUM_WARPS, heads), float32)
        merge_sum = cuda.shared.array((NUM_WARPS, heads), float32)
        merge_acc = cuda.shared.array((NUM_WARPS, heads, head_size), float32)
        q = cuda.local.array((heads, dims), float32)
        acc = cuda.local.array((heads, dims), float32)
        run_max = cuda.local.array(heads, float32)
        run_sum = cuda.local.array(heads, float32)
        scores = cuda.local.array((heads, tokens_in_flight), float32)

        for g in range(heads):
            for j in range(loads_per_lane):
                for e in range(vec):
                    dim = (sub + j * lanes) * vec + e
                    q[g, j * vec + e] = widen(query[seq, first_head + g, dim]) * float32(scale)
                    acc[g, j * vec + e] = zero
            run_max[g] = neg_inf
            run_sum[g] = zero

        run_steps(part_start, part_end, warp, slot, sub, seq, kv_head, block_tables, key_cache, value_cache,
                  rows_per_block, num_kv_heads, q, acc, run_max, run_sum, scores, scratch, tid)
        # Merge the lane groups of each warp (lanes with the same `sub` hold the same dims).
        offset = lanes
        while offset < WARP:
            for g in range(heads):
                other_max = xor_lane(run_max[g], offset, scratch, tid)
                other_sum = xor_lane(run_sum[g], offset, scratch, tid)
                best = other_max if other_max > run_max[g] else run_max[g]
                mine = math.exp(run_max[g] - best) if run_max[g] > neg_inf else zero
                theirs = math.exp(other_max - best) if other_max > neg_inf else zero
                run_sum[g] = run_sum[g] * mine + other_sum * theirs
                for d in range(dims):
                    other = xor_lane(acc[g, d], offset, scratch, tid)
                    acc[g, d] = acc[g, d] * mine + other * theirs
                run_max[g] = best
            offset *= 2
        # Merge the warps through shared memory.
        if slot == 0:
            for g in range(heads):
                if sub == 0:
                    merge_max[warp, g] = run_max[g]
                    merge_sum[warp, g] = run_sum[g]
                for j in range(loads_per_lane):
                    for e in range(vec):
                        merge_acc[warp, g, (sub + j * lanes) * vec + e] = acc[g, j * vec + e]
        cuda.syncthreads()
        for i in range(tid, heads * head_size, THREADS):
            g = i // head_size
            dim = i - g * head_size
            best = neg_inf
            for w in range(NUM_WARPS):
                if merge_max[w, g] > best:
                    best = merge_max[w, g]
            total = zero
            value = zero
            for w in range(NUM_WARPS):
                if merge_max[w, g] > neg_inf:
                    weight = math.exp(merge_max[w, g] - best)
                    total += merge_sum[w, g] * weight
                    value += merge_acc[w, g, dim] * weight
            if num_parts == 1:
                out[seq, first_head + g, dim] = narrow(value / total)
            else:
                part_out[seq, first_head + g, part, dim] = value
                if dim == 0:
                    part_max[seq, first_head + g, part] = best
                    part_sum[seq, first_head + g, part] = total

    return kernel


def grid_x(num_kv_heads: int, group: int, layout: WarpLayout) -> int:
    """Blocks along x: one per (KV head, chunk of its query heads)."""
    return num_kv_heads * (group // layout.heads_per_block)
