"""GPU timings of the CUDA kernels against PyTorch on the same device, and against the bandwidth floor.

Used by ``python -m bench.kernels.bench_kernels`` when a CUDA device is present.

Each row is the median of ``repeats`` CUDA-event timings after warm-up, cycling
through enough independent input sets that they do not fit in L2 (so the
figure is HBM bandwidth, not cache). Two times per row: ``call ms`` has the
events around one call on an idle GPU, so it includes the host's launch
cost where the GPU waits for it (what a caller sees); ``device ms`` first
queues a ~5 ms spin on the GPU (``torch.cuda._sleep``), so every launch of
the call is queued before the GPU reaches the start event and the events
time the device work alone. Bandwidth is computed from ``device ms``. ``bytes`` is the least the op must move:
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

from bench.kernels.gpu_reference import shuffled_block_tables
from bench.kernels.kernels_before import write_kv_cache_per_element
from kernels import fast_launch, paged_attention_decode, preprocess_images, write_kv_cache
from kernels.image_preprocess import pack_images
from kernels.paged_attention_warp import layout_for

L2_MULTIPLE = 4  # input sets together span at least this many L2 caches


SPIN_CYCLES = 10_000_000  # ~5 ms at H100/H200 clocks: longer than any call's host time below


@dataclass(frozen=True)
class GpuRow:
    op: str
    shape: str
    dtype: str
    variant: str
    ms: float  # per call, host launch included where the GPU waits for it
    device_ms: float | None  # device work alone (launches queued behind a spin)
    bytes_moved: int
    gb_per_s: float
    of_copy: float
    of_peak: float | None


@dataclass(frozen=True)
class Variant:
    """One way of doing an op, to be timed: ``fn(i)`` runs it on input set ``i``."""

    name: str
    fn: Callable[[int], object]
    num_sets: int
    bytes_moved: int
    device_timed: bool = True  # False where the host's time is the point (per-image loops, host packing)


def measure(variant: Variant, repeats: int) -> tuple[float, float | None]:
    """(call ms, device ms) of one variant."""
    call = event_median_ms(variant.fn, variant.num_sets, repeats)
    device = event_median_ms(variant.fn, variant.num_sets, repeats, device_only=True) if variant.device_timed else None
    return call, device


def event_median_ms(fn: Callable[[int], object], num_sets: int, repeats: int, *, device_only: bool = False) -> float:
    for i in range(3):
        fn(i % num_sets)
    torch.cuda.synchronize()
    samples = []
    for i in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if device_only:
            torch.cuda._sleep(SPIN_CYCLES)
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


def attention_sets(num_seqs: int, num_heads: int, num_kv_heads: int, head_size: int, ctx: tuple[int, int],
                   dtype: torch.dtype, block_size: int = 16) -> tuple[list[list[torch.Tensor]], int, int]:
    """(input sets [query, key_cache, value_cache, block_tables, context_lens] cycled past L2, the bytes a
    call must move, block-table width) for decode attention at random contexts in ``ctx``."""
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
    return sets, kv_bytes + io_bytes, width


def attention_variants(num_seqs: int, num_heads: int, num_kv_heads: int, head_size: int, ctx: tuple[int, int],
                       dtype: torch.dtype, block_size: int = 16) -> list[Variant]:
    sets, moved, width = attention_sets(num_seqs, num_heads, num_kv_heads, head_size, ctx, dtype, block_size)
    out = torch.empty((num_seqs, num_heads, head_size), dtype=dtype, device="cuda")
    scale = head_size**-0.5

    def ours(partition_size, kernel="warp", layout=None):
        return lambda i: paged_attention_decode(*sets[i], block_size, scale, out=out, backend="cuda",
                                                partition_size=partition_size, cuda_kernel=kernel, warp_layout=layout)

    fewer_floats = layout_for(head_size, num_heads // num_kv_heads, torch.finfo(dtype).bits // 8, lane_floats=32)

    gather_sdpa = gather_sdpa_call(sets, width, block_size, scale)
    n = len(sets)
    return [
        Variant("ours: warp kernel (auto partitions)", ours(None), n, moved),
        Variant("ours: warp kernel, unsplit", ours(1 << 30), n, moved),
        Variant("ours: warp kernel, 512-token partitions", ours(512), n, moved),
        Variant("ours: warp kernel, 32 lane floats (more lanes/token)", ours(None, layout=fewer_floats), n, moved),
        Variant("tile kernel (first H200 design), auto", ours(None, "tile"), n, moved),
        Variant("ours (auto), generic Numba launch", generic_launch(ours(None)), n, moved),
        Variant("torch gather + SDPA", gather_sdpa, n, moved),
    ]


def gather_sdpa_call(sets: list[list[torch.Tensor]], width: int, block_size: int, scale: float) -> Callable[[int], object]:
    """PyTorch without us: each sequence's K/V gathered by its block table, then fused SDPA under a length mask;
    ``call(i)`` returns ``[num_seqs, num_heads, 1, head_size]`` for input set ``i``."""
    positions = torch.arange(width * block_size, device="cuda")

    def gather_sdpa(i):
        query, key_cache, value_cache, tables, lens_d = sets[i]
        num_seqs, num_kv_heads, head_size = query.shape[0], key_cache.shape[2], key_cache.shape[3]
        keys = key_cache[tables.long()].reshape(num_seqs, -1, num_kv_heads, head_size).transpose(1, 2)
        values = value_cache[tables.long()].reshape(num_seqs, -1, num_kv_heads, head_size).transpose(1, 2)
        mask = (positions[None, :] < lens_d[:, None])[:, None, None, :]
        return F.scaled_dot_product_attention(query[:, :, None, :], keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=True)

    return gather_sdpa


def kv_cache_variants(num_tokens: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                      block_size: int = 16) -> list[Variant]:
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
    from numba import cuda

    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)

    def index_copy(i):
        key, value, key_cache, value_cache, slots = sets[i]
        key_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slots, key)
        value_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slots, value)

    def ours(i):
        write_kv_cache(*sets[i], backend="cuda")

    print(f"  write_kv_cache {num_tokens} tokens {dtype}: host us per call: fast launch "
          f"{host_us_per_call(ours, len(sets)):.1f}, generic {host_us_per_call(generic_launch(ours), len(sets)):.1f}, "
          f"torch index_copy_ {host_us_per_call(index_copy, len(sets)):.1f}")
    n = len(sets)
    return [
        Variant("ours", ours, n, moved),
        Variant("ours, generic Numba launch", generic_launch(ours), n, moved),
        Variant("first kernel (one thread per element)", lambda i: write_kv_cache_per_element(*sets[i], stream), n,
                moved),
        Variant("torch index_copy_", index_copy, n, moved),
    ]


def preprocess_variants(num_images: int, low: int, high: int, out_px: int, dtype) -> list[Variant]:
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
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    device_images = [torch.from_numpy(i).cuda() for i in images]
    from kernels import image_preprocess as images_module

    kernel = images_module.preprocess_kernel(np.dtype(dtype).name, 3)
    grid, block = images_module.cuda_launch_shape(tuple(out.shape))
    vector_stores = int(images_module.uses_vector_stores(out, np.dtype(dtype)))

    def kernel_only(_):
        kernel[grid, block, stream](*device_inputs, scale_d, bias_d, out_d, vector_stores)

    def first_kernel(_):  # one thread per output pixel
        images_module._preprocess_cuda_per_pixel[(-(-out_px // 32), -(-out_px // 4), num_images), (32, 4, 1), stream](
            *device_inputs, scale_d, bias_d, out_d)

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
        Variant("ours, kernel only (packed input on the GPU)", kernel_only, 1, moved),
        Variant("first kernel (one thread per pixel), kernel only", first_kernel, 1, moved),
        Variant("torch F.interpolate per image, on the GPU", torch_on_device, 1, moved, device_timed=False),
        Variant("ours, public call: pack + H2D + kernel", public, 1, moved, device_timed=False),
        Variant("torch per image: H2D + interpolate", torch_from_host, 1, moved, device_timed=False),
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
             lambda d=dtype: attention_variants(64, 4, 2, 32, (1024, 2048), d)),
            ("paged_attention_decode", "256 seqs, tinylm 4/2 heads x 32, ctx 1024-2048, block 16", name,
             lambda d=dtype: attention_variants(256, 4, 2, 32, (1024, 2048), d)),
            ("paged_attention_decode", "64 seqs, 32/8 heads x 128, ctx 1024-2048, block 16", name,
             lambda d=dtype: attention_variants(64, 32, 8, 128, (1024, 2048), d)),
            ("paged_attention_decode", "8 seqs, 32/8 heads x 128, ctx 4096, block 16", name,
             lambda d=dtype: attention_variants(8, 32, 8, 128, (4096, 4096), d)),
            ("write_kv_cache", "prefill scatter: 16384 tokens, 8 kv heads x 128", name,
             lambda d=dtype: kv_cache_variants(16384, 8, 128, d)),
            ("write_kv_cache", "decode step: 256 tokens, 2 kv heads x 32", name,
             lambda d=dtype: kv_cache_variants(256, 2, 32, d)),
        ]
    for out_dtype in (np.float32, np.float16):
        suites.append(("preprocess_images", "256 images 64-512 px -> 224x224", np.dtype(out_dtype).name,
                       lambda d=out_dtype: preprocess_variants(256, 64, 512, 224, d)))
    suites.append(("preprocess_images", "1024 images 16-64 px -> 32x32", "float32",
                   lambda: preprocess_variants(1024, 16, 64, 32, np.float32)))
    for op, shape, dtype_name, make in suites:
        try:
            variants = make()
        except Exception as error:
            print(f"{op} {shape} {dtype_name}: {type(error).__name__}: {error}")
            continue
        first = len(rows)
        for variant in variants:
            try:  # one failing variant (e.g. out of memory) must not lose the rest
                call_ms, device_ms = measure(variant, repeats)
            except Exception as error:
                print(f"  {variant.name}: {type(error).__name__}: {error}")
                continue
            gb = variant.bytes_moved / ((device_ms or call_ms) * 1e-3) / 1e9
            rows.append(GpuRow(op, shape, dtype_name, variant.name, call_ms, device_ms, variant.bytes_moved, gb,
                               gb / copy, gb / peak_gb_per_s if peak_gb_per_s else None))
        print_rows(rows[first:])
        torch.cuda.empty_cache()
    from kernels import paged_attention

    print(f"warp attention kernel failures (rows named 'warp' then ran the tile kernel): {paged_attention._warp_failures}")
    return copy, rows


def print_rows(rows: list[GpuRow]) -> None:
    for r in rows:
        peak = f"{r.of_peak:.0%}" if r.of_peak else "n/a"
        device = f"{r.device_ms:>8.4f}" if r.device_ms is not None else "       -"
        print(f"{r.op:<22} {r.dtype:<8} {r.shape:<52} {r.variant:<44} call {r.ms:>8.4f} ms device {device} ms "
              f"{r.gb_per_s:>6.0f} GB/s {r.of_copy:>4.0%} of copy {peak:>4} of peak")
