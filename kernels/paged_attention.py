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

    out[s, h] = softmax(cap(scale * q[s, h] · K[s, first:ctx])) · V[s, first:ctx]

where ``first = max(0, ctx - sliding_window)`` with a window (the query, at
position ``ctx - 1``, sees the last ``sliding_window`` tokens, itself
included; transformers' ``kv_idx > q_idx - W``) and 0 without one, and
``cap(s) = softcap * tanh(s / softcap)`` with a cap (Gemma 2's
``attn_logit_softcapping``) and ``s`` without one. Keys before ``first`` are
never read.

Decode attention reads every cached K/V byte once per step and does two FLOPs
per byte loaded, so it is bound by memory bandwidth; the kernels are written
to read K/V once, contiguously, and never materialize the gathered context.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import numba
import numpy as np
from numba import cuda

from kernels import paged_attention_warp as warp
from kernels.backend import (
    Backend,
    DeviceLaunch,
    all_on_device,
    as_torch,
    cpu_threads_for,
    dtype_name,
    host_view,
    is_torch_tensor,
    resolve_backend,
)
from kernels.element_formats import as_kernel_array, format_itemsize
from kernels.paged_attention_cuda import THREADS, attention_kernels, merge_kernel, partition_length
from kernels.validation import check_array, check_contiguous, check_dim
from kernels.vector_access import start_alignment

log = logging.getLogger(__name__)
_FLOAT_DTYPES = ("float32", "float16", "bfloat16")  # bfloat16: PyTorch tensors (numpy has none)

# Reassociation lets LLVM vectorize the dot products and sums; no nnan/ninf,
# because the softmax relies on exp(-inf) == 0 semantics staying honest.
_CPU_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


@numba.njit(parallel=True, cache=True, fastmath=_CPU_FASTMATH)
def _paged_attention_cpu(out, query, key_cache, value_cache, block_tables, context_lens, block_size, scale,
                         sliding_window, softcap):
    """CPU twin: one (sequence, KV head) per iteration, serving all query heads of its group.

    Each K/V row is loaded once for the whole group. Two passes (scores, then
    values) over a scratch of group * (context_len - first) scores: on a CPU
    that buffer sits in cache, so the max-then-sum softmax is cheaper than an
    online one. A window only moves the first token (the blocks before it are
    skipped); the cap is a pass of its own over a head's scores before its
    softmax, so neither touches the dot loops. (A cap pass over all the
    group's scores at once changed how LLVM vectorized the uncapped path:
    results moved by an ulp.)
    """
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    for item in numba.prange(num_seqs * num_kv_heads):
        seq = item // num_kv_heads
        kv_head = item - seq * num_kv_heads
        first_head = kv_head * group
        context_len = context_lens[seq]
        first = 0
        if sliding_window > 0 and context_len > sliding_window:
            first = context_len - sliding_window
        num_keys = context_len - first
        first_block = first // block_size
        num_logical_blocks = (context_len + block_size - 1) // block_size
        q = np.empty((group, head_size), np.float32)
        for g in range(group):
            for dim in range(head_size):
                q[g, dim] = query[seq, first_head + g, dim] * scale
        scores = np.empty((group, num_keys), np.float32)
        for logical_block in range(first_block, num_logical_blocks):
            block = block_tables[seq, logical_block]
            start = logical_block * block_size
            # Rows counted from 0 and shifted: a range from max(first - start, 0) made LLVM compile the
            # whole-context loop ~5% slower.
            skipped = max(first - start, 0)  # > 0 only in the window's first block
            for row in range(min(block_size, context_len - start) - skipped):
                offset = skipped + row
                for g in range(group):
                    dot = np.float32(0.0)
                    for dim in range(head_size):
                        dot += q[g, dim] * key_cache[block, offset, kv_head, dim]
                    scores[g, start + offset - first] = dot
        inv_sums = np.empty(group, np.float32)
        for g in range(group):
            if softcap > 0:
                for t in range(num_keys):
                    scores[g, t] = softcap * np.tanh(scores[g, t] / softcap)
            peak = scores[g, 0]
            for t in range(1, num_keys):
                peak = max(peak, scores[g, t])
            total = np.float32(0.0)
            for t in range(num_keys):
                p = np.exp(scores[g, t] - peak)
                scores[g, t] = p
                total += p
            inv_sums[g] = np.float32(1.0) / total
        acc = np.zeros((group, head_size), np.float32)
        for logical_block in range(first_block, num_logical_blocks):
            block = block_tables[seq, logical_block]
            start = logical_block * block_size
            skipped = max(first - start, 0)
            for row in range(min(block_size, context_len - start) - skipped):
                offset = skipped + row
                for g in range(group):
                    p = scores[g, start + offset - first]
                    for dim in range(head_size):
                        acc[g, dim] += p * value_cache[block, offset, kv_head, dim]
        for g in range(group):
            for dim in range(head_size):
                out[seq, first_head + g, dim] = acc[g, dim] * inv_sums[g]


def paged_attention_decode_reference(query, key_cache, value_cache, block_tables, context_lens, block_size, scale,
                                     sliding_window=0, softcap=0.0):
    """PyTorch reference, gather-then-dense: per sequence, gather its K/V by block table, keep the window's
    tokens, then matmul, cap and softmax.

    Computes in float32 whatever the input dtype and returns the query's dtype.
    """
    import torch

    q_all, key_cache_t, value_cache_t = as_torch(query), as_torch(key_cache), as_torch(value_cache)
    in_dtype = q_all.dtype
    q_all = q_all.float()
    tables = as_torch(block_tables).long()
    num_seqs, num_heads, head_size = q_all.shape
    num_kv_heads = key_cache_t.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q_all)
    for seq, context_len in enumerate(as_torch(context_lens).tolist()):
        blocks = tables[seq, : (context_len + block_size - 1) // block_size]
        keys = key_cache_t[blocks].reshape(-1, num_kv_heads, head_size)[:context_len].float()  # [ctx, kv, d]
        values = value_cache_t[blocks].reshape(-1, num_kv_heads, head_size)[:context_len].float()
        if sliding_window > 0:  # positions >= context_len - sliding_window
            keys, values = keys[-sliding_window:], values[-sliding_window:]
        q = q_all[seq].reshape(num_kv_heads, group, head_size)
        scores = torch.bmm(q, keys.permute(1, 2, 0)) * scale  # [kv, group, ctx]
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        probs = torch.softmax(scores, dim=-1)
        out[seq] = torch.bmm(probs, values.permute(1, 0, 2)).reshape(num_heads, head_size)
    return out.to(in_dtype)


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
    *,
    partition_size: int | None = None,
    cuda_kernel: str = "warp",
    warp_layout: warp.WarpLayout | None = None,
    sliding_window: int = 0,
    softcap: float = 0.0,
):
    """Decode attention over paged KV; returns ``out`` (allocated like ``query`` when None).

    Layouts are in the module docstring. Arrays are numpy, PyTorch (CPU or
    CUDA) or Numba device arrays, all on the host or all on the GPU. On host
    arrays the context lengths and the block-table entries they reach are
    checked (ValueError); on GPU arrays that check would synchronize and is
    skipped. float16 and bfloat16 query/K/V/out (bfloat16 as PyTorch tensors)
    run on the CUDA and reference backends (accumulating in float32); the CPU
    twin takes float32.
    ``partition_size`` (CUDA only) fixes the context partition length of the
    split-context kernel; None lets it fill the GPU (see
    ``kernels.paged_attention_cuda``). ``cuda_kernel`` picks the CUDA kernel:
    ``"warp"`` (``kernels.paged_attention_warp``, 16-byte loads, the default)
    or ``"tile"`` (the first kernel, ``kernels.paged_attention_cuda``), kept
    for comparison. ``warp_layout`` replaces the warp kernel's own choice of
    load width, lanes, heads per block and tokens in flight (for tuning;
    ``kernels.paged_attention_warp.layout_for``).
    ``sliding_window`` (an int >= 0) limits each query to the last that many
    tokens of its context and ``softcap`` (a finite float >= 0) caps the
    scores (the module docstring); 0 turns either off. On CUDA the cap is
    compiled into the kernel (one build per value) and the window is a
    launch argument.
    """
    if cuda_kernel not in ("warp", "tile"):
        raise ValueError(f"cuda_kernel must be 'warp' or 'tile'; got {cuda_kernel!r}")
    num_seqs, num_heads, head_size = check_array(
        "query", query, dtypes=_FLOAT_DTYPES, layout=("num_seqs", "num_heads", "head_size")
    )
    dtype = dtype_name(query)
    if dtype == "bfloat16" and cuda_kernel == "tile":
        raise ValueError("cuda_kernel 'tile' takes float32 or float16; bfloat16 runs on the warp kernel")
    cache_layout = ("num_blocks", "block_size", "num_kv_heads", "head_size")
    cache_shape = check_array("key_cache", key_cache, dtypes=(dtype,), layout=cache_layout)
    value_cache_shape = check_array("value_cache", value_cache, dtypes=(dtype,), layout=cache_layout)
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
    sliding_window, softcap = _check_window_and_cap(sliding_window, softcap)
    if out is not None:
        out_shape = check_array("out", out, dtypes=(dtype,), layout=("num_seqs", "num_heads", "head_size"))
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
    if dtype != "float32" and chosen is Backend.CPU:
        raise ValueError(f"backend 'cpu' takes float32 arrays; got {dtype} ({dtype} runs on 'cuda' or 'reference')")

    if chosen is Backend.REFERENCE:
        as_torch(out).copy_(
            paged_attention_decode_reference(query, key_cache, value_cache, block_tables, context_lens,
                                             block_size, scale, sliding_window, softcap)
        )
    elif chosen is Backend.CPU:
        if on_device:
            raise ValueError("backend 'cpu' needs host arrays; got GPU arrays")
        paged_attention_decode_host(
            host_view(out),
            np.ascontiguousarray(host_view(query)),
            np.ascontiguousarray(host_view(key_cache)),
            np.ascontiguousarray(host_view(value_cache)),
            np.ascontiguousarray(host_view(block_tables)),
            np.ascontiguousarray(host_view(context_lens)),
            block_size,
            scale,
            sliding_window,
            softcap,
        )
    else:
        _launch_cuda(arrays, out, num_kv_heads, int(block_size), float(scale), partition_size, cuda_kernel,
                     warp_layout, sliding_window, softcap)
    return out


def paged_attention_decode_host(out: np.ndarray, query: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray,
                                block_tables: np.ndarray, context_lens: np.ndarray, block_size: int,
                                scale: float, sliding_window: int = 0, softcap: float = 0.0) -> None:
    """The CPU twin on arrays the caller has checked, writing ``out``: C-contiguous float32 numpy
    arrays in the layouts above, int32 tables and lengths in range (what ``paged_attention_decode``
    checks). Nothing is checked here; an index out of range reads outside the caches. For a model
    that checks its step once and calls this in every layer: the checks, backend choice and views
    cost ~17 us a call, about a sixth of a batch-1 tinylm step."""
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    num_tokens = int(np.minimum(context_lens, sliding_window).sum() if sliding_window else context_lens.sum())
    with cpu_threads_for(2 * num_tokens * num_kv_heads * head_size * 4):
        _paged_attention_cpu(out, query, key_cache, value_cache, block_tables, context_lens, int(block_size),
                             np.float32(scale), int(sliding_window), np.float32(softcap))


def _launch_cuda(arrays: dict[str, Any], out: Any, num_kv_heads: int, block_size: int, scale: float,
                 partition_size: int | None, cuda_kernel: str, warp_layout: warp.WarpLayout | None,
                 sliding_window: int, softcap: float) -> None:
    """Launches the split-context kernel (and its merge when the context is split) on PyTorch's stream.

    Partitions start at each sequence's window (``kernels.paged_attention_cuda``), so with a window the
    grid spans the window, not the table."""
    num_seqs, num_heads, head_size = arrays["query"].shape
    group, dtype = num_heads // num_kv_heads, dtype_name(arrays["key_cache"])
    arrays = {name: as_kernel_array(array) for name, array in arrays.items()}  # bfloat16 as its int16 bits
    out = as_kernel_array(out)
    # bfloat16 has no tile kernel: a warp kernel that cannot build is an error there, not a fallback.
    tile_kernel = attention_kernels(head_size, group, dtype, softcap=softcap)[0] if dtype != "bfloat16" else None
    merge = merge_kernel(head_size, dtype)
    threads = THREADS
    if cuda_kernel == "warp" and (not _warp_failures or tile_kernel is None):
        itemsize = format_itemsize(dtype)
        max_width = min(start_alignment(arrays["key_cache"]), start_alignment(arrays["value_cache"]))
        layout = warp_layout or warp.layout_for(head_size, group, itemsize, max_width=max_width)
        if warp_layout is not None:  # layout_for's own choices fit by construction
            layout.check(head_size, group, itemsize)
            if layout.width > max_width:
                raise ValueError(f"warp_layout width {layout.width} exceeds the caches' alignment ({max_width} bytes)")
        partition_kernel, blocks_x = warp.warp_attention_kernel(head_size, group, dtype, layout, softcap), \
            warp.grid_x(num_kv_heads, group, layout)
        threads = warp.THREADS
    else:
        partition_kernel, blocks_x = tile_kernel, num_kv_heads
    max_span = arrays["block_tables"].shape[1] * block_size  # the most tokens a sequence attends to
    if sliding_window:
        max_span = min(max_span, sliding_window)
    if partition_size is None:
        part_len = partition_length(max_span, num_seqs * blocks_x, 4 * _multiprocessor_count())
    elif partition_size < 1:
        raise ValueError(f"partition_size must be >= 1; got {partition_size}")
    else:
        part_len = min(int(partition_size), max_span)
    num_parts = -(-max_span // part_len)
    launch = DeviceLaunch([*arrays.values(), out])
    inputs = [arrays[name] for name in ("query", "key_cache", "value_cache", "block_tables", "context_lens")]
    if num_parts == 1:
        part_max = part_sum = part_out = launch.scratch((1, 1, 1, 1))
    else:
        part_max = launch.scratch((num_seqs, num_heads, num_parts))
        part_sum = launch.scratch((num_seqs, num_heads, num_parts))
        part_out = launch.scratch((num_seqs, num_heads, num_parts, head_size))
    args = [out, part_max, part_sum, part_out, *inputs, block_size, scale, part_len, sliding_window]
    try:
        launch.launch(partition_kernel, (blocks_x, num_seqs, num_parts), threads, args, outputs=(0,))
    except Exception as error:  # a Numba/NVVM that cannot build the vector loads: serve with the first kernel
        if partition_kernel is tile_kernel or tile_kernel is None:
            raise
        _warp_failures.append(f"{type(error).__name__}: {error}")
        log.warning("warp attention kernel failed to build or launch, using the tile kernel: %s", _warp_failures[-1])
        launch.launch(tile_kernel, (num_kv_heads, num_seqs, num_parts), THREADS, args, outputs=(0,))
    if num_parts > 1:
        launch.launch(merge, (num_heads, num_seqs), THREADS,
                      [out, part_max, part_sum, part_out, arrays["context_lens"], part_len, sliding_window],
                      outputs=(0,))


_warp_failures: list[str] = []  # why the warp kernel is off in this process, if it is


@functools.cache
def _multiprocessor_count() -> int:
    try:
        return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
    except AttributeError:  # the simulator has no such attribute
        return 1


def _check_window_and_cap(sliding_window: Any, softcap: Any) -> tuple[int, float]:
    """The two options as an int and a float, or ValueError (bools are refused: neither is a flag)."""
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int | np.integer) or sliding_window < 0:
        raise ValueError(f"sliding_window must be an int >= 0 (0: the whole context); got {sliding_window!r}")
    if (isinstance(softcap, bool) or not isinstance(softcap, int | float | np.integer | np.floating)
            or not math.isfinite(softcap) or softcap < 0):
        raise ValueError(f"softcap must be a finite float >= 0 (0: no cap); got {softcap!r}")
    return int(sliding_window), float(softcap)


def _empty_like(query: Any):
    if is_torch_tensor(query):
        import torch

        return torch.empty_like(query, memory_format=torch.contiguous_format)
    if hasattr(query, "__cuda_array_interface__"):
        return cuda.device_array(tuple(query.shape), dtype=np.dtype(query.dtype))
    return np.empty(query.shape, np.dtype(query.dtype))


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
