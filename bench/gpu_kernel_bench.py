"""GPU timings of the CUDA kernels against PyTorch on the same device, and against the bandwidth floor.

Used by ``python -m bench.bench_kernels`` when a CUDA device is present.

Each row is the median of ``repeats`` CUDA-event timings after warm-up, cycling
through enough independent input sets that they do not fit in L2 (so the
figure is HBM bandwidth, not cache). ``bytes`` is the least the op must move:
for attention every K/V byte of every context once plus query and output;
for the cache write the new K/V read once and written once; for images the
source bytes read once and the output written once. ``of copy`` divides the
achieved GB/s by a device-to-device copy measured in the same run (bytes read
plus written), ``of peak`` by the datasheet-style peak (2 × memory clock × bus
width from the device attributes).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from bench.gpu_kernel_check import shuffled_block_tables
from bench.paged_attention_v1 import paged_attention_v1
from kernels import fast_launch, paged_attention_decode, preprocess_images, write_kv_cache
from kernels.image_preprocess import _preprocess_cuda, pack_images

L2_MULTIPLE = 4  # input sets together span at least this many L2 caches


@dataclass(frozen=True)
class GpuRow:
    op: str
    shape: str
    dtype: str
    variant: str
    ms: float
    bytes_moved: int
    gb_per_s: float
    of_copy: float
    of_peak: float | None


def event_median_ms(fn: Callable[[int], object], num_sets: int, repeats: int) -> float:
    for i in range(3):
        fn(i % num_sets)
    torch.cuda.synchronize()
    samples = []
    for i in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i % num_sets)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def generic_launch(fn: Callable[[int], object]) -> Callable[[int], object]:
    """The same call with kernels.fast_launch off (Numba's own argument handling every launch)."""

    def call(i: int) -> object:
        fast_launch.set_enabled(False)
        try:
            return fn(i)
        finally:
            fast_launch.set_enabled(True)

    return call


def host_us_per_call(fn: Callable[[int], object], num_sets: int, calls: int = 200) -> float:
    """Host time per call with nothing waited for: the launch overhead when the GPU keeps up."""
    for i in range(3):
        fn(i % num_sets)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(calls):
        fn(i % num_sets)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def copy_gb_per_s(repeats: int) -> float:
    """Device-to-device copy of 2 GiB, counting bytes read plus written."""
    src = torch.empty(1 << 29, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = event_median_ms(lambda _: dst.copy_(src), 1, repeats)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def _sets_needed(bytes_per_set: int) -> int:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return min(64, max(2, -(-L2_MULTIPLE * l2 // max(bytes_per_set, 1))))


def attention_rows(num_seqs: int, num_heads: int, num_kv_heads: int, head_size: int, ctx: tuple[int, int],
                   dtype: torch.dtype, repeats: int, block_size: int = 16) -> list[tuple[str, float, int]]:
    gen = torch.Generator().manual_seed(0)
    cuda_gen = torch.Generator(device="cuda").manual_seed(0)
    lens = torch.randint(ctx[0], ctx[1] + 1, (num_seqs,), generator=gen, dtype=torch.int32)
    blocks_per_seq = (lens + block_size - 1) // block_size
    width = int(blocks_per_seq.max())
    num_blocks = int(blocks_per_seq.sum())
    kv_bytes = 2 * int(lens.sum()) * num_kv_heads * head_size * torch.finfo(dtype).bits // 8
    io_bytes = 2 * num_seqs * num_heads * head_size * torch.finfo(dtype).bits // 8
    sets = []
    for _ in range(_sets_needed(kv_bytes)):
        tables = shuffled_block_tables(blocks_per_seq.tolist(), num_blocks, width, gen, fill=0)
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        sets.append([torch.randn((num_seqs, num_heads, head_size), generator=cuda_gen, device="cuda").to(dtype),
                     torch.randn(shape, generator=cuda_gen, device="cuda").to(dtype),
                     torch.randn(shape, generator=cuda_gen, device="cuda").to(dtype), tables.cuda(), lens.cuda()])
    out = torch.empty((num_seqs, num_heads, head_size), dtype=dtype, device="cuda")
    scale = head_size**-0.5
    positions = torch.arange(width * block_size, device="cuda")

    def ours(partition_size):
        return lambda i: paged_attention_decode(*sets[i], block_size, scale, out=out, backend="cuda",
                                                partition_size=partition_size)

    def gather_sdpa(i):
        query, key_cache, value_cache, tables, lens_d = sets[i]
        keys = key_cache[tables.long()].reshape(num_seqs, -1, num_kv_heads, head_size).transpose(1, 2)
        values = value_cache[tables.long()].reshape(num_seqs, -1, num_kv_heads, head_size).transpose(1, 2)
        mask = (positions[None, :] < lens_d[:, None])[:, None, None, :]
        return F.scaled_dot_product_attention(query[:, :, None, :], keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=True)

    variants: list[tuple[str, Callable[[int], object]]] = [
        ("ours (auto partitions)", ours(None)),
        ("ours (auto), generic Numba launch", generic_launch(ours(None))),
        ("ours, unsplit", ours(1 << 30)),
        ("ours, 256-token partitions", ours(256)),
        ("ours, 512-token partitions", ours(512)),
        ("torch gather + SDPA", gather_sdpa),
    ]
    if dtype == torch.float32:
        variants.append(("first kernel (per query head)", lambda i: paged_attention_v1(
            *sets[i], block_size, scale, out)))
    rows = []
    for name, fn in variants:
        try:
            rows.append((name, event_median_ms(fn, len(sets), repeats), kv_bytes + io_bytes))
        except Exception as error:  # one failing baseline (e.g. out of memory) must not lose the rest
            print(f"  {name}: {type(error).__name__}: {error}")
    return rows


def kv_cache_rows(num_tokens: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                  repeats: int, block_size: int = 16) -> list[tuple[str, float, int]]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    num_blocks = 4 * -(-num_tokens // block_size)
    row_bytes = num_kv_heads * head_size * torch.finfo(dtype).bits // 8
    moved = 2 * 2 * num_tokens * row_bytes  # K and V, read once and written once
    sets = []
    for _ in range(_sets_needed(moved)):
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        sets.append([
            torch.randn((num_tokens, num_kv_heads, head_size), generator=gen, device="cuda").to(dtype),
            torch.randn((num_tokens, num_kv_heads, head_size), generator=gen, device="cuda").to(dtype),
            torch.zeros(shape, dtype=dtype, device="cuda"), torch.zeros(shape, dtype=dtype, device="cuda"),
            torch.randperm(num_blocks * block_size, generator=gen, device="cuda")[:num_tokens],
        ])

    def index_copy(i):
        key, value, key_cache, value_cache, slots = sets[i]
        key_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slots, key)
        value_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slots, value)

    def ours(i):
        write_kv_cache(*sets[i], backend="cuda")

    print(f"  write_kv_cache {num_tokens} tokens {dtype}: host us per call: fast launch "
          f"{host_us_per_call(ours, len(sets)):.1f}, generic {host_us_per_call(generic_launch(ours), len(sets)):.1f}, "
          f"torch index_copy_ {host_us_per_call(index_copy, len(sets)):.1f}")
    return [
        ("ours", event_median_ms(ours, len(sets), repeats), moved),
        ("ours, generic Numba launch", event_median_ms(generic_launch(ours), len(sets), repeats), moved),
        ("torch index_copy_", event_median_ms(index_copy, len(sets), repeats), moved),
    ]


def preprocess_rows(num_images: int, low: int, high: int, out_px: int, dtype, repeats: int
                    ) -> list[tuple[str, float, int]]:
    rng = np.random.default_rng(2)
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    sizes = rng.integers(low, high + 1, size=(num_images, 2))
    images = [rng.integers(0, 256, (int(h), int(w), 3), dtype=np.uint8) for h, w in sizes]
    source_bytes = sum(i.size for i in images)
    out_bytes = num_images * 3 * out_px * out_px * np.dtype(dtype).itemsize
    torch_dtype = torch.float16 if dtype == np.float16 else torch.float32
    packed = pack_images(images)
    scale = torch.tensor([1 / (255 * s) for s in std], device="cuda")
    bias = torch.tensor([-m / s for m, s in zip(mean, std, strict=True)], device="cuda")
    from numba import cuda

    device_inputs = [cuda.as_cuda_array(torch.from_numpy(a).cuda()) for a in
                     (packed.pixels, packed.offsets, packed.heights, packed.widths)]
    scale_d, bias_d = cuda.as_cuda_array(scale), cuda.as_cuda_array(bias)
    out = torch.empty((num_images, 3, out_px, out_px), dtype=torch_dtype, device="cuda")
    out_d = cuda.as_cuda_array(out)
    grid = (-(-out_px // 32), -(-out_px // 4), num_images)
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    device_images = [torch.from_numpy(i).cuda() for i in images]

    def kernel_only(_):
        _preprocess_cuda[grid, (32, 4, 1), stream](*device_inputs, scale_d, bias_d, out_d)

    def torch_on_device(_):  # images already on the GPU, one interpolate per image (sizes differ)
        for k, image in enumerate(device_images):
            resized = F.interpolate(image.permute(2, 0, 1)[None].float(), size=(out_px, out_px), mode="bilinear",
                                    align_corners=False)
            out[k] = (resized[0] * scale[:, None, None] + bias[:, None, None]).to(torch_dtype)

    def public(_):
        preprocess_images(images, out_px, out_px, mean, std, out_dtype=dtype, backend="cuda")

    def torch_from_host(_):
        for k, image in enumerate(images):
            resized = F.interpolate(torch.from_numpy(image).cuda().permute(2, 0, 1)[None].float(),
                                    size=(out_px, out_px), mode="bilinear", align_corners=False)
            out[k] = (resized[0] * scale[:, None, None] + bias[:, None, None]).to(torch_dtype)

    moved = source_bytes + out_bytes
    return [
        ("ours, kernel only (packed input on the GPU)", event_median_ms(kernel_only, 1, repeats), moved),
        ("torch F.interpolate per image, on the GPU", event_median_ms(torch_on_device, 1, repeats), moved),
        ("ours, public call: pack + H2D + kernel", event_median_ms(public, 1, repeats), moved),
        ("torch per image: H2D + interpolate", event_median_ms(torch_from_host, 1, repeats), moved),
    ]


def gpu_rows(repeats: int, peak_gb_per_s: float | None) -> tuple[float, list[GpuRow]]:
    copy = copy_gb_per_s(repeats)
    print(f"fast launch available: {fast_launch.enabled()}")
    print(f"device-to-device copy: {copy:.0f} GB/s (read + write); datasheet-style peak: "
          f"{peak_gb_per_s or float('nan'):.0f} GB/s")
    rows: list[GpuRow] = []
    suites = []
    for dtype in (torch.float32, torch.float16):
        name = str(dtype)[6:]
        suites += [
            ("paged_attention_decode", "64 seqs, tinylm 4/2 heads x 32, ctx 1024-2048, block 16", name,
             lambda d=dtype: attention_rows(64, 4, 2, 32, (1024, 2048), d, repeats)),
            ("paged_attention_decode", "256 seqs, tinylm 4/2 heads x 32, ctx 1024-2048, block 16", name,
             lambda d=dtype: attention_rows(256, 4, 2, 32, (1024, 2048), d, repeats)),
            ("paged_attention_decode", "64 seqs, 32/8 heads x 128, ctx 1024-2048, block 16", name,
             lambda d=dtype: attention_rows(64, 32, 8, 128, (1024, 2048), d, repeats)),
            ("paged_attention_decode", "8 seqs, 32/8 heads x 128, ctx 4096, block 16", name,
             lambda d=dtype: attention_rows(8, 32, 8, 128, (4096, 4096), d, repeats)),
            ("write_kv_cache", "prefill scatter: 16384 tokens, 8 kv heads x 128", name,
             lambda d=dtype: kv_cache_rows(16384, 8, 128, d, repeats)),
            ("write_kv_cache", "decode step: 256 tokens, 2 kv heads x 32", name,
             lambda d=dtype: kv_cache_rows(256, 2, 32, d, repeats)),
        ]
    for out_dtype in (np.float32, np.float16):
        suites.append(("preprocess_images", "256 images 64-512 px -> 224x224", np.dtype(out_dtype).name,
                       lambda d=out_dtype: preprocess_rows(256, 64, 512, 224, d, repeats)))
    suites.append(("preprocess_images", "1024 images 16-64 px -> 32x32", "float32",
                   lambda: preprocess_rows(1024, 16, 64, 32, np.float32, repeats)))
    for op, shape, dtype_name, run in suites:
        try:
            measured = run()
        except Exception as error:
            print(f"{op} {shape} {dtype_name}: {type(error).__name__}: {error}")
            continue
        for variant, ms, moved in measured:
            gb = moved / (ms * 1e-3) / 1e9
            rows.append(GpuRow(op, shape, dtype_name, variant, ms, moved, gb, gb / copy,
                               gb / peak_gb_per_s if peak_gb_per_s else None))
        print_rows(rows[-len(measured):])
    return copy, rows


def print_rows(rows: list[GpuRow]) -> None:
    for r in rows:
        peak = f"{r.of_peak:.0%}" if r.of_peak else "n/a"
        print(f"{r.op:<22} {r.dtype:<8} {r.shape:<52} {r.variant:<44} {r.ms:>9.4f} ms {r.gb_per_s:>7.0f} GB/s "
              f"{r.of_copy:>5.0%} of copy {peak:>5} of peak")
