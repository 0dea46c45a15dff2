"""Kernel benchmark: each CPU twin against its PyTorch reference, and the CUDA kernels when a GPU is present.

    .venv/bin/python -m bench.kernels.bench_kernels [--repeats 15] [--small]

Times are medians over ``--repeats`` runs after warm-up runs (Numba compile
excluded). CPU rows compare the public function on ``backend="cpu"`` with the
PyTorch reference on the same inputs; the issue's targets are a ratio ≤ 1.5,
and < 1 for ``paged_attention_decode`` against the gather-then-dense reference.
With a GPU (``numba.cuda.is_available()``) the CUDA kernels are timed with CUDA
events on PyTorch's stream, and each row reports achieved bandwidth against
the device's peak. ``--small`` shrinks every size, for a smoke run under
``NUMBA_ENABLE_CUDASIM=1`` (where GPU timings are meaningless).

Prints a table and writes ``bench/results/kernels.json``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numba
import numpy as np
import torch

from bench.harness.results import RESULTS_DIR, write_report
from bench.kernels.device import peak_bandwidth_gb_per_s
from kernels import paged_attention_decode, preprocess_images, write_kv_cache
from kernels.backend import cuda_available
from kernels.image_preprocess import preprocess_images_reference
from kernels.kv_cache import write_kv_cache_reference
from kernels.paged_attention import paged_attention_decode_reference

RESULTS_PATH = RESULTS_DIR / "kernels.json"
MAX_RATIO = 1.5
MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]


@dataclass(frozen=True)
class Sizes:
    kv_num_tokens: int = 512
    kv_num_blocks: int = 2048
    attn_num_seqs: int = 32
    attn_num_heads: int = 8
    attn_num_kv_heads: int = 2
    head_size: int = 64
    attn_context_min: int = 448
    attn_context_max: int = 576
    block_size: int = 16
    small_images: int = 32
    small_image_min_px: int = 64
    small_image_max_px: int = 256
    small_image_out_px: int = 32
    large_images: int = 64
    large_image_out_px: int = 224


SMALL = Sizes(kv_num_tokens=24, kv_num_blocks=8, attn_num_seqs=3, attn_num_heads=4, attn_num_kv_heads=2,
              head_size=16, attn_context_min=5, attn_context_max=40, block_size=8, small_images=3,
              small_image_min_px=4, small_image_max_px=20, small_image_out_px=6, large_images=2,
              large_image_out_px=9)


@dataclass(frozen=True)
class Workload:
    """One op at one size: the inputs and how to run it on each backend."""

    op: str
    shape: str
    bytes_moved: int  # bytes the op must read and write at minimum
    run_kernel: Callable[[str], object]  # takes the backend name
    run_reference: Callable[[], object]
    reference_name: str = "torch reference"
    # Extra PyTorch baselines, reported beside the reference but not part of the target.
    baselines: tuple[tuple[str, Callable[[], object]], ...] = ()


@dataclass(frozen=True)
class CpuRow:
    op: str
    shape: str
    reference: str
    reference_ms: float
    cpu_twin_ms: float
    ratio: float  # cpu_twin_ms / reference_ms
    target_ratio: float
    meets_target: bool


@dataclass(frozen=True)
class CudaRow:
    op: str
    shape: str
    cuda_ms: float
    torch_reference_ms: float
    achieved_gb_per_s: float
    peak_gb_per_s: float | None
    fraction_of_peak: float | None


def kv_cache_workload(rng: np.random.Generator, s: Sizes, to_array: Callable = lambda a: a) -> Workload:
    row = (s.attn_num_kv_heads, s.head_size)
    key = to_array(rng.standard_normal((s.kv_num_tokens, *row), dtype=np.float32))
    value = to_array(rng.standard_normal((s.kv_num_tokens, *row), dtype=np.float32))
    cache_shape = (s.kv_num_blocks, s.block_size, *row)
    key_cache = to_array(np.zeros(cache_shape, np.float32))
    value_cache = to_array(np.zeros(cache_shape, np.float32))
    slots = rng.permutation(s.kv_num_blocks * s.block_size)[: s.kv_num_tokens].astype(np.int64)
    slots[:: max(1, s.kv_num_tokens // 16)] = -1  # some padding tokens
    slot_mapping = to_array(slots)
    num_written = int((slots >= 0).sum())
    return Workload(
        op="write_kv_cache",
        shape=f"{s.kv_num_tokens} tokens, {s.attn_num_kv_heads} kv heads x {s.head_size}",
        bytes_moved=2 * 2 * num_written * s.attn_num_kv_heads * s.head_size * 4,
        run_kernel=lambda backend: write_kv_cache(key, value, key_cache, value_cache, slot_mapping, backend=backend),
        run_reference=lambda: write_kv_cache_reference(key, value, key_cache, value_cache, slot_mapping),
    )


def attention_workload(rng: np.random.Generator, s: Sizes, to_array: Callable = lambda a: a) -> Workload:
    context_lens = rng.integers(s.attn_context_min, s.attn_context_max + 1, size=s.attn_num_seqs).astype(np.int32)
    blocks_per_seq = (context_lens + s.block_size - 1) // s.block_size
    num_blocks = int(blocks_per_seq.sum())
    pool = rng.permutation(num_blocks).astype(np.int32)
    block_tables = np.zeros((s.attn_num_seqs, int(blocks_per_seq.max())), np.int32)
    start = 0
    for seq, count in enumerate(blocks_per_seq):
        block_tables[seq, :count] = pool[start : start + count]
        start += count
    cache_shape = (num_blocks, s.block_size, s.attn_num_kv_heads, s.head_size)
    args = (
        to_array(rng.standard_normal((s.attn_num_seqs, s.attn_num_heads, s.head_size), dtype=np.float32)),
        to_array(rng.standard_normal(cache_shape, dtype=np.float32)),
        to_array(rng.standard_normal(cache_shape, dtype=np.float32)),
        to_array(block_tables),
        to_array(context_lens),
        s.block_size,
        s.head_size**-0.5,
    )
    out = to_array(np.empty((s.attn_num_seqs, s.attn_num_heads, s.head_size), np.float32))
    kv_bytes = 2 * int(context_lens.sum()) * s.attn_num_kv_heads * s.head_size * 4
    return Workload(
        op="paged_attention_decode",
        shape=(f"{s.attn_num_seqs} seqs, {s.attn_num_heads}/{s.attn_num_kv_heads} heads x {s.head_size}, "
               f"ctx {s.attn_context_min}-{s.attn_context_max}, block {s.block_size}"),
        bytes_moved=kv_bytes,
        run_kernel=lambda backend: paged_attention_decode(*args, out=out, backend=backend),
        run_reference=lambda: paged_attention_decode_reference(*args),
        reference_name="torch per-seq gather + bmm",
        baselines=(("torch batched gather + masked bmm", lambda: batched_gather_attention(*args)),),
    )


def batched_gather_attention(query, key_cache, value_cache, block_tables, context_lens, block_size, scale):
    """A stronger PyTorch baseline than the reference: one gather for the whole batch, padded and masked."""
    q, k_cache, v_cache = (torch.as_tensor(a) for a in (query, key_cache, value_cache))
    tables = torch.as_tensor(block_tables).long().clamp_min(0)
    lens = torch.as_tensor(context_lens)
    num_seqs, num_heads, head_size = q.shape
    num_kv_heads = k_cache.shape[2]
    num_tokens = tables.shape[1] * block_size
    keys = k_cache[tables].reshape(num_seqs, num_tokens, num_kv_heads, head_size).permute(0, 2, 3, 1)
    values = v_cache[tables].reshape(num_seqs, num_tokens, num_kv_heads, head_size).permute(0, 2, 1, 3)
    scores = torch.matmul(q.reshape(num_seqs, num_kv_heads, -1, head_size), keys) * scale
    padding = torch.arange(num_tokens, device=lens.device)[None, :] >= lens[:, None]
    scores.masked_fill_(padding[:, None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), values).reshape(num_seqs, num_heads, head_size)


def preprocess_workload(rng: np.random.Generator, num_images: int, min_px: int, max_px: int, out_px: int,
                        out_dtype=np.float32) -> Workload:
    sizes = rng.integers(min_px, max_px + 1, size=(num_images, 2))
    images = [rng.integers(0, 256, (int(h), int(w), 3), dtype=np.uint8) for h, w in sizes]
    out_bytes = num_images * 3 * out_px * out_px * np.dtype(out_dtype).itemsize
    dtype_note = "" if out_dtype == np.float32 else f", {np.dtype(out_dtype).name}"
    return Workload(
        op="preprocess_images",
        shape=f"{num_images} images {min_px}-{max_px}px -> {out_px}x{out_px}{dtype_note}",
        bytes_moved=sum(i.size for i in images) + out_bytes,
        run_kernel=lambda backend: preprocess_images(images, out_px, out_px, MEAN, STD, out_dtype=out_dtype,
                                                     backend=backend),
        run_reference=lambda: preprocess_images_reference(images, out_px, out_px, MEAN, STD, out_dtype),
    )


def median_ms(fn: Callable[[], object], *, warmup: int, repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def cpu_rows(s: Sizes, repeats: int) -> list[CpuRow]:
    rng = np.random.default_rng(0)
    workloads = [
        kv_cache_workload(rng, s),
        attention_workload(rng, s),
        preprocess_workload(rng, s.small_images, s.small_image_min_px, s.small_image_max_px, s.small_image_out_px),
        preprocess_workload(rng, s.large_images, s.small_image_min_px, s.small_image_max_px, s.large_image_out_px),
        preprocess_workload(rng, s.large_images, s.small_image_min_px, s.small_image_max_px, s.large_image_out_px,
                            np.float16),
    ]
    rows = []
    for w in workloads:
        reference_ms = median_ms(w.run_reference, warmup=2, repeats=repeats)
        cpu_ms = median_ms(lambda w=w: w.run_kernel("cpu"), warmup=2, repeats=repeats)
        target = 1.0 if w.op == "paged_attention_decode" else MAX_RATIO
        ratio = cpu_ms / reference_ms
        meets = ratio < target if w.op == "paged_attention_decode" else ratio <= target
        rows.append(CpuRow(w.op, w.shape, w.reference_name, reference_ms, cpu_ms, ratio, target, meets))
        for name, baseline in w.baselines:
            baseline_ms = median_ms(baseline, warmup=2, repeats=repeats)
            rows.append(CpuRow(w.op, w.shape, name + " (extra)", baseline_ms, cpu_ms, cpu_ms / baseline_ms,
                               float("nan"), True))
    return rows


def cuda_rows(s: Sizes, repeats: int) -> list[CudaRow]:
    """Times the CUDA kernels on device-resident inputs: torch CUDA tensors, or Numba arrays on the simulator."""
    from numba import cuda

    if torch.cuda.is_available():
        def to_array(a):
            return torch.from_numpy(a).cuda()

        def sync():
            torch.cuda.synchronize()
    else:
        to_array, sync = cuda.to_device, cuda.synchronize

    rng = np.random.default_rng(0)
    workloads = [kv_cache_workload(rng, s, to_array), attention_workload(rng, s, to_array)]
    peak = peak_bandwidth_gb_per_s()
    rows = []
    for w in workloads:
        cuda_ms = _event_median_ms(lambda w=w: w.run_kernel("cuda"), repeats, sync)
        reference_ms = _event_median_ms(w.run_reference, repeats, sync) if torch.cuda.is_available() else float("nan")
        achieved = w.bytes_moved / (cuda_ms * 1e-3) / 1e9 if cuda_ms > 0 else float("nan")
        rows.append(CudaRow(w.op, w.shape, cuda_ms, reference_ms, achieved, peak,
                            achieved / peak if peak else None))
    for num_images, out_px in ((s.small_images, s.small_image_out_px), (s.large_images, s.large_image_out_px)):
        w = preprocess_workload(rng, num_images, s.small_image_min_px, s.small_image_max_px, out_px)
        cuda_ms = _event_median_ms(lambda w=w: w.run_kernel("cuda"), repeats, sync)
        achieved = w.bytes_moved / (cuda_ms * 1e-3) / 1e9 if cuda_ms > 0 else float("nan")
        # The reference is the CPU one here: images arrive on the host, as in the worker.
        rows.append(CudaRow(w.op, w.shape + " (incl. host packing + H2D)", cuda_ms, float("nan"), achieved, peak,
                            achieved / peak if peak else None))
    return rows


def _event_median_ms(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    if not torch.cuda.is_available():  # simulator: events carry no time
        return median_ms(fn, warmup=1, repeats=repeats, sync=sync)
    for _ in range(3):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def print_cpu_table(rows: list[CpuRow]) -> None:
    print(f"CPU ({numba.get_num_threads()} numba threads, {torch.get_num_threads()} torch threads, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    print(f"{'op':<24} {'shape':<62} {'reference':<36} {'ref ms':>9} {'twin ms':>9} {'ratio':>6}  target")
    for r in rows:
        sign = "<" if r.op == "paged_attention_decode" else "<="
        target = "-" if np.isnan(r.target_ratio) else f"{sign}{r.target_ratio:g} {'ok' if r.meets_target else 'MISSED'}"
        print(f"{r.op:<24} {r.shape:<62} {r.reference:<36} {r.reference_ms:>9.3f} {r.cpu_twin_ms:>9.3f} "
              f"{r.ratio:>6.2f}  {target}")


def print_cuda_table(rows: list[CudaRow]) -> None:
    print(f"{'op':<24} {'shape':<62} {'cuda ms':>9} {'torch ms':>9} {'GB/s':>8} {'peak GB/s':>9} {'of peak':>7}")
    for r in rows:
        peak = f"{r.peak_gb_per_s:.0f}" if r.peak_gb_per_s else "n/a"
        frac = f"{r.fraction_of_peak:.0%}" if r.fraction_of_peak else "n/a"
        print(f"{r.op:<24} {r.shape:<62} {r.cuda_ms:>9.3f} {r.torch_reference_ms:>9.3f} "
              f"{r.achieved_gb_per_s:>8.1f} {peak:>9} {frac:>7}")


def _device_name() -> str:
    from numba import cuda

    try:
        name = cuda.get_current_device().name
    except AttributeError:
        return "Numba CUDA simulator: timings meaningless"
    return name.decode() if isinstance(name, bytes) else str(name)


def _threading_layer() -> str:
    try:
        return numba.threading_layer()
    except ValueError:  # no parallel region has run yet
        return "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--small", action="store_true", help="tiny sizes, for a smoke run (e.g. on the CUDA simulator)")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for both numba and torch (default: each library's own default)")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    parser.add_argument("--quick", action="store_true", help="5 repeats instead of --repeats")
    parser.add_argument("--gpu-only", action="store_true", help="skip the CPU rows")
    args = parser.parse_args()
    if args.quick:
        args.repeats = min(args.repeats, 5)
    sizes = SMALL if args.small else Sizes()
    if args.threads:
        numba.set_num_threads(args.threads)
        torch.set_num_threads(args.threads)

    cpu = [] if args.gpu_only else cpu_rows(sizes, args.repeats)
    if cpu:
        print_cpu_table(cpu)
    cuda = None
    gpu = None
    copy_gb_per_s = None
    if torch.cuda.is_available() and cuda_available():
        from bench.kernels.gpu_timing import gpu_rows

        print(f"\nGPU ({_device_name()}), medians of {max(args.repeats, 30)} CUDA-event timings")
        copy_gb_per_s, gpu = gpu_rows(max(args.repeats, 30), peak_bandwidth_gb_per_s())
    elif cuda_available():  # the simulator: a smoke run of the launch paths, timings meaningless
        print(f"\nCUDA ({_device_name()})")
        cuda = cuda_rows(sizes, args.repeats)
        print_cuda_table(cuda)
    else:
        print("\nCUDA: no GPU (numba.cuda.is_available() is False); GPU rows skipped")

    args.output.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "numba_threads": numba.get_num_threads(),
            "numba_threading_layer": _threading_layer(),
            "cpu_count": os.cpu_count(),
            "load_average_1m": os.getloadavg()[0],
            "torch_threads": torch.get_num_threads(),
            "numba": numba.__version__,
            "torch": torch.__version__,
            "numpy": np.__version__,
        },
        "sizes": asdict(sizes),
        "repeats": args.repeats,
        "cpu": [asdict(r) for r in cpu],
        "cuda_device": _device_name() if cuda is not None or gpu is not None else None,
        "cuda": [asdict(r) for r in cuda] if cuda is not None else None,
        "gpu_copy_gb_per_s": copy_gb_per_s,
        "gpu_peak_gb_per_s": peak_bandwidth_gb_per_s() if gpu is not None else None,
        "gpu": [asdict(r) for r in gpu] if gpu is not None else None,
    }
    write_report(args.output, report)


if __name__ == "__main__":
    main()
