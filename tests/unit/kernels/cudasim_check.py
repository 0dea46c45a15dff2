"""Runs the CUDA kernels under Numba's simulator against the references, on small shapes.

Run as its own process, because NUMBA_ENABLE_CUDASIM is read when numba is
imported:

    NUMBA_ENABLE_CUDASIM=1 PYTHONPATH=. python tests/unit/kernels/cudasim_check.py [--quick] [kv_cache|attention|images ...]

Prints one line per case and exits non-zero on the first mismatch. --quick (what `make test` runs
under CI=true) keeps one case per kernel variant and drops the repeats that cost most in the
simulator (attention's MHA x24, MQA x160, float16 and 1-token-in-flight layouts; image widths 5 and
264); `make test-all` runs the whole sweep.
"""

from __future__ import annotations

import os
import sys

import numpy as np

TOLERANCE = 1e-4


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got64 - want64) / max(np.linalg.norm(want64), 1e-30))


def check(name: str, got: np.ndarray, want: np.ndarray, tolerance: float = TOLERANCE) -> None:
    if got.shape != want.shape:
        sys.exit(f"FAIL {name}: shape {got.shape} != {want.shape}")
    error = relative_error(got, want)
    if not error <= tolerance:
        sys.exit(f"FAIL {name}: relative error {error:.3g} > {tolerance:g}")
    print(f"ok {name}: relative error {error:.2e}")


def check_write_kv_cache(rng: np.random.Generator, quick: bool) -> None:  # noqa: ARG001 - cheap: always whole
    # (num_kv_heads, head_size, dtype, first element, num_tokens, access width): 16-byte rows; rows of 6 and
    # 20 bytes, which narrower accesses tile; views one element into their buffers, not 16-byte aligned, so
    # the kernel drops to the element width. 210 tokens x 5 chunks span two thread blocks and a partial one.
    cases = [
        (2, 8, np.float32, 0, 9, 16),
        (3, 16, np.float16, 0, 9, 16),
        (1, 3, np.float16, 0, 9, 2),
        (1, 5, np.float32, 0, 210, 4),
        (2, 8, np.float32, 1, 9, 4),
        (2, 8, np.float16, 1, 9, 2),
    ]
    for case in cases:
        _check_write_kv_cache_case(rng, *case)
    _check_out_of_range_slots_are_dropped(rng)


def _offset_array(rng: np.random.Generator, shape: tuple[int, ...], dtype, offset: int) -> np.ndarray:
    """A random C-contiguous array starting ``offset`` elements into its buffer."""
    size = int(np.prod(shape))
    return rng.standard_normal(size + offset, dtype=np.float32).astype(dtype)[offset:].reshape(shape)


def _check_write_kv_cache_case(rng: np.random.Generator, num_kv_heads: int, head_size: int, dtype, offset: int,
                               num_tokens: int, want_width: int) -> None:
    from kernels import write_kv_cache
    from kernels.kv_cache import _access_width

    num_blocks, block_size = 64, 4
    cache_shape = (num_blocks, block_size, num_kv_heads, head_size)
    # Block starts/ends and the last slot, then shuffled slots; every third token is padding.
    slots = np.concatenate([[0, block_size - 1, num_blocks * block_size - 1],
                            rng.permutation(np.arange(block_size, num_blocks * block_size - 1))])[:num_tokens]
    slots[2::3] = -1
    key = _offset_array(rng, (num_tokens, num_kv_heads, head_size), dtype, offset)
    value = _offset_array(rng, key.shape, dtype, offset)
    initial = _offset_array(rng, cache_shape, dtype, 0)
    label = f"{np.dtype(dtype).name} {num_kv_heads}x{head_size}, offset {offset}, {num_tokens} tokens"
    caches = {}
    for backend in ("cuda", "reference"):
        key_cache, value_cache = _offset_array(rng, cache_shape, dtype, offset), _offset_array(rng, cache_shape, dtype, offset)
        key_cache[...], value_cache[...] = initial, initial + 1
        caches[backend] = (key_cache, value_cache)
    width = _access_width([key, value, *caches["cuda"]], num_kv_heads * head_size * key.itemsize,
                          itemsize=key.itemsize)
    if width != want_width:
        sys.exit(f"FAIL write_kv_cache {label}: {width}-byte accesses, expected {want_width}")
    for backend, (key_cache, value_cache) in caches.items():
        write_kv_cache(key, value, key_cache, value_cache, slots, backend=backend)
    # A scatter does no arithmetic, so the caches must agree to the bit.
    for i, name in enumerate(("key_cache", "value_cache")):
        got, want = caches["cuda"][i], caches["reference"][i]
        if got.tobytes() != want.tobytes():
            sys.exit(f"FAIL write_kv_cache {label} ({width}-byte accesses): {name} differs from the reference")
    print(f"ok write_kv_cache {label}: {width}-byte accesses, bit-exact")


def _check_out_of_range_slots_are_dropped(rng: np.random.Generator) -> None:
    """Device slots are not range-checked on the host; the kernel itself must skip those past the cache."""
    from kernels.kv_cache import THREADS_PER_BLOCK, _scatter_kernel

    key = rng.standard_normal((3, 2, 8), dtype=np.float32)
    key_cache = rng.standard_normal((2, 4, 2, 8), dtype=np.float32)
    value_cache = key_cache + 1
    want_key, want_value = key_cache.copy(), value_cache.copy()
    want_key[0, 1], want_value[0, 1] = key[1], key[1] + 2
    slots = np.array([8, 1, 1 << 40], np.int64)  # one past the last slot, a kept one, far past
    _scatter_kernel(64, 16, 4)[1, THREADS_PER_BLOCK](key, key + 2, key_cache, value_cache, slots)
    check("write_kv_cache kernel drops out-of-range slots (key_cache)", key_cache, want_key, 0.0)
    check("write_kv_cache kernel drops out-of-range slots (value_cache)", value_cache, want_value, 0.0)


def _attention_case(rng: np.random.Generator, context_lens: list[int], *, num_heads: int, num_kv_heads: int,
                    head_size: int, block_size: int, dtype=np.float32, distinct_blocks: bool = False):
    lens = np.array(context_lens, np.int32)
    blocks_per_seq = (lens + block_size - 1) // block_size
    max_blocks = int(blocks_per_seq.max())
    num_blocks = (int(blocks_per_seq.sum()) if distinct_blocks else max_blocks) + 3
    cache_shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = rng.standard_normal(cache_shape, dtype=np.float32).astype(dtype)
    value_cache = rng.standard_normal(cache_shape, dtype=np.float32).astype(dtype)
    # Each sequence its own shuffled table (not the identity), padded with -1 past its blocks; with
    # distinct_blocks no two sequences share a block.
    tables = np.full((len(lens), max_blocks + 1), -1, np.int32)
    pool = rng.permutation(num_blocks) if distinct_blocks else None
    for row, n in enumerate(blocks_per_seq):
        if pool is not None:
            tables[row, :n], pool = pool[:n], pool[n:]
        else:
            tables[row, :n] = rng.permutation(num_blocks)[:n]
    query = (rng.standard_normal((len(lens), num_heads, head_size), dtype=np.float32) * 3).astype(dtype)
    return query, key_cache, value_cache, tables, lens, block_size, head_size**-0.5


def check_paged_attention(rng: np.random.Generator, quick: bool) -> None:
    from kernels import paged_attention_decode
    from kernels.paged_attention_cuda import DEFAULT_TILE

    # 1 token; exactly one block; a partial last block; more than one tile.
    gqa = _attention_case(rng, [1, 8, 19, DEFAULT_TILE + 13], num_heads=4, num_kv_heads=2, head_size=16,
                          block_size=8)
    want = paged_attention_decode(*gqa, backend="reference")
    check(f"paged_attention_decode GQA 4/2 x16, ctx 1..{DEFAULT_TILE + 13}, split into 24-token partitions + merge",
          paged_attention_decode(*gqa, backend="cuda", partition_size=24), want)
    check("paged_attention_decode same, the tile kernel (cuda_kernel='tile', the warp kernel's fallback)",
          paged_attention_decode(*gqa, backend="cuda", partition_size=24, cuda_kernel="tile"), want)
    from kernels.paged_attention_warp import WarpLayout

    # Two sequences are enough for the rest: the simulator runs every thread in Python (~1 s per block).
    pair = _attention_case(rng, [19, DEFAULT_TILE + 13], num_heads=4, num_kv_heads=2, head_size=16, block_size=8)
    check("paged_attention_decode GQA 4/2 x16, 2 seqs, prefetching the next 32-token step's K/V (2 steps)",
          paged_attention_decode(*pair, backend="cuda", warp_layout=WarpLayout(16, 4, 2, 1, prefetch=True)),
          paged_attention_decode(*pair, backend="reference"))
    _check_packed_16_bit(pair, quick)
    _check_window_and_cap(rng, quick)
    if quick:
        return
    check("paged_attention_decode same 2 seqs, one partition, warp layout of one query head per block, "
          "1 token in flight",
          paged_attention_decode(*pair, backend="cuda", warp_layout=WarpLayout(16, 2, 1, 1)),
          paged_attention_decode(*pair, backend="reference"))
    mha = _attention_case(rng, [5, 21], num_heads=2, num_kv_heads=2, head_size=24, block_size=4)
    check("paged_attention_decode MHA 2/2 x24 (head size not a multiple of 8), 16-token partitions",
          paged_attention_decode(*mha, backend="cuda", partition_size=16),
          paged_attention_decode(*mha, backend="reference"))
    wide = _attention_case(rng, [3, 20], num_heads=3, num_kv_heads=1, head_size=160, block_size=16)
    check("paged_attention_decode MQA 3/1 x160 (two dims per thread)",
          paged_attention_decode(*wide, backend="cuda"), paged_attention_decode(*wide, backend="reference"))
    half = tuple(a.astype(np.float16) if isinstance(a, np.ndarray) and a.dtype == np.float32 else a for a in pair)
    got16 = paged_attention_decode(*half, backend="cuda", partition_size=32)
    if got16.dtype != np.float16:
        sys.exit(f"FAIL paged_attention_decode float16: dtype {got16.dtype}")
    check("paged_attention_decode float16 K/V/query, 2 seqs, split", got16,
          paged_attention_decode(*half, backend="reference"), 2e-3)


def _check_packed_16_bit(pair, quick: bool) -> None:
    """16-bit K/V kept packed two to a register (float16, and bfloat16 as PyTorch tensors of int16 bits), split
    into partitions so the merge kernel writes the 16-bit output too; against the float32 reference of the
    same rounded inputs. The output's own rounding bounds the error: float16 2e-3, bfloat16 4e-3."""
    import torch

    from kernels import paged_attention_decode
    from kernels.paged_attention_warp import WarpLayout

    formats = [(torch.bfloat16, 4e-3)] if quick else [(torch.bfloat16, 4e-3), (torch.float16, 2e-3)]
    layouts = [WarpLayout(16, 2, 2, 2, packed=True, prefetch=True, fastmath=True)]
    if not quick:
        layouts += [WarpLayout(16, 2, 2, 1, prefetch=True, packed=True), WarpLayout(4, 4, 1, 1, packed=True),
                    WarpLayout(16, 2, 2, 2, packed=True)]
    for dtype, bound in formats:
        rounded = [torch.from_numpy(a).to(dtype) if isinstance(a, np.ndarray) and a.dtype == np.float32
                   else torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in pair]
        want = paged_attention_decode(*[a.float() if isinstance(a, torch.Tensor) and a.dtype == dtype else a
                                        for a in rounded], backend="reference")
        name = str(dtype).removeprefix("torch.")
        for layout in layouts:
            out = torch.full_like(rounded[0], float("nan"))
            paged_attention_decode(*rounded, backend="cuda", warp_layout=layout, partition_size=24, out=out)
            check(f"paged_attention_decode {name} packed K/V, {layout}, 24-token partitions + merge",
                  out.float().numpy(), want.numpy(), bound)
        if not quick:
            check(f"paged_attention_decode {name}, the default layout",
                  paged_attention_decode(*rounded, backend="cuda").float().numpy(), want.numpy(), bound)


def _poison_before_window(case, sliding_window: int):
    """NaN in each sequence's K/V rows before its window: a kernel that loads one returns NaN, even at weight 0."""
    _, key_cache, value_cache, tables, lens, block_size, _ = case
    for seq, context_len in enumerate(lens):
        for t in range(max(0, int(context_len) - sliding_window)):
            key_cache[tables[seq, t // block_size], t % block_size] = np.nan
            value_cache[tables[seq, t // block_size], t % block_size] = np.nan
    return case


def _check_window_and_cap(rng: np.random.Generator, quick: bool) -> None:
    """sliding_window and softcap. Partitions start at each sequence's window: with a 22-token window and
    11-token partitions the grid has 2, the 45-token sequence attends to tokens 23..44 (from the middle of
    a block of 8) over both and the 5-token one fills 1 and leaves 1 empty, which the merge must skip.
    K/V before the window is NaN, so a load there shows. One KV head for a GQA group of 4 keeps the
    simulated blocks few."""
    from kernels import paged_attention_decode

    window, cap = 22, 5.0
    case = _poison_before_window(_attention_case(rng, [5, 45], num_heads=4, num_kv_heads=1, head_size=16,
                                                 block_size=8, distinct_blocks=True), window)
    half = tuple(a.astype(np.float16) if isinstance(a, np.ndarray) and a.dtype == np.float32 else a for a in case)
    # (name, inputs, kernel, tolerance): float32 through the warp kernel's plain fold and the tile kernel,
    # float16 through the warp kernel's default 16-bit layout (packed K/V, prefetch, fast math).
    runs = [("float32 warp", case, "warp", TOLERANCE), ("float32 tile", case, "tile", TOLERANCE),
            ("float16 warp", half, "warp", 2e-3)]
    if not quick:
        runs.append(("float16 tile", half, "tile", 2e-3))
    for name, inputs, kernel, tolerance in runs:
        want = paged_attention_decode(*inputs, backend="reference", sliding_window=window, softcap=cap)
        got = paged_attention_decode(*inputs, backend="cuda", cuda_kernel=kernel, partition_size=11,
                                     sliding_window=window, softcap=cap)
        check(f"paged_attention_decode GQA 4/1 x16 {name}, window {window} + softcap {cap}, 11-token partitions "
              f"(one sequence's second empty) + merge", got, want, tolerance)
    if quick:
        return
    # The cap alone (on K/V without NaN) and a 1-token window, one partition each, so the partition kernel
    # writes out itself; a window starting at a block boundary (45 - 13 = 32) over 4 partitions of 4 tokens.
    clean = _attention_case(rng, [5, 45], num_heads=4, num_kv_heads=1, head_size=16, block_size=8)
    for name, inputs, options, partition_size in (("softcap alone", clean, {"softcap": cap}, None),
                                                  ("window of 1", case, {"sliding_window": 1}, None),
                                                  ("window 13 from a block boundary", case, {"sliding_window": 13}, 4)):
        want = paged_attention_decode(*inputs, backend="reference", **options)
        for kernel in ("warp", "tile"):
            check(f"paged_attention_decode float32 {kernel}, {name}, partitions of {partition_size or 'the whole'}",
                  paged_attention_decode(*inputs, backend="cuda", cuda_kernel=kernel, partition_size=partition_size,
                                         **options), want)


def check_preprocess(rng: np.random.Generator, quick: bool) -> None:
    from kernels import preprocess_images

    sizes = [(1, 1), (1, 40), (30, 2), (9, 7), (3, 5)]  # 1x1, extreme aspect ratios, down- and upscaling
    # Widths 5 and 262: plain stores, with a partial last group of 4 pixels; 8 and 264: vector stores.
    # 262 and 264 span two blocks along x (64 threads of 4 pixels, then the rest), 6 rows two along y.
    # Quick: vector stores in one block (8), plain stores with a partial group over two blocks (262).
    for out_width in (8, 262) if quick else (5, 8, 262, 264):
        for channels, mean, std in ((3, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]), (1, [0.5], [0.25])):
            images = [rng.integers(0, 256, (h, w, channels), dtype=np.uint8) for h, w in sizes]
            want = preprocess_images(images, 6, out_width, mean, std, backend="reference")
            got = preprocess_images(images, 6, out_width, mean, std, backend="cuda").copy_to_host()
            check(f"preprocess_images C={channels} 6x{out_width} float32", got, want)
            got16 = preprocess_images(images, 6, out_width, mean, std, out_dtype=np.float16,
                                      backend="cuda").copy_to_host()
            if got16.dtype != np.float16:
                sys.exit(f"FAIL preprocess_images float16: dtype {got16.dtype}")
            # Rounded from the same float32 values, so equal to the float32 output rounded, to the bit.
            check(f"preprocess_images C={channels} 6x{out_width} float16 (float32 output rounded)", got16,
                  got.astype(np.float16), 0.0)
            check(f"preprocess_images C={channels} 6x{out_width} float16", got16, want, 1e-3)


def main() -> None:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        sys.exit("set NUMBA_ENABLE_CUDASIM=1: this script checks the CUDA kernels on the simulator")
    from tests.unit.kernels import cudasim_blocks

    cudasim_blocks.install()  # the simulator's blocks without its polling loop: the same simulation, less CPU
    parts = {"kv_cache": check_write_kv_cache, "attention": check_paged_attention, "images": check_preprocess}
    args = sys.argv[1:]
    quick = "--quick" in args
    chosen = [a for a in args if a != "--quick"] or list(parts)
    unknown = sorted(set(chosen) - set(parts))
    if unknown:
        sys.exit(f"unknown parts {unknown}; choose from {sorted(parts)}")
    rng = np.random.default_rng(1234)
    for name in chosen:
        parts[name](rng, quick)
    print("all CUDA kernels match the references")


if __name__ == "__main__":
    main()
