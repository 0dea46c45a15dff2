"""The CUDA kernels against float64 references at real shapes, on a GPU.

    python -m bench.kernels.bench_gpu_kernel_check [--output bench/results/gpu_kernel_check.json]

Needs a CUDA device (exits 2 without one). Every case draws fresh random
inputs, poisons the output with NaN first (so an unwritten element fails), and
reports the relative Frobenius error ‖got − ref‖ / ‖ref‖ against a float64
reference computed from the same (upcast) inputs. Bounds: 1e-5 for float32,
2e-3 for float16 outputs (half precision rounds at ~5e-4). Covers ragged
contexts, partial last blocks, shuffled block tables padded with -1, MHA / GQA
/ MQA, head sizes 32 to 256, batch 1 to 256, contexts up to 4096, split and
unsplit attention, sliding windows and softcaps at Gemma 2/3's and Mistral v0.1's shapes (K/V before
each window poisoned with NaN), prefill-sized cache scatters and ragged image batches.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from bench.harness.results import RESULTS_DIR, write_report
from bench.kernels.gpu_reference import (
    BOUND,
    attention_inputs,
    attention_reference64,
    relative_error,
)
from kernels import paged_attention_decode, preprocess_images, write_kv_cache
from kernels.image_preprocess import preprocess_images_reference

RESULTS_PATH = RESULTS_DIR / "gpu_kernel_check.json"


@dataclass(frozen=True)
class CheckResult:
    op: str
    case: str
    dtype: str
    relative_error: float
    bound: float
    ok: bool


def check_attention(gen: torch.Generator, results: list[CheckResult]) -> None:
    cases = [  # name, lens, heads, kv heads, head size, block size
        ("tinylm GQA 4/2x32, batch 1, ctx 4096", [4096], 4, 2, 32, 16),
        ("tinylm GQA 4/2x32, batch 64, ragged 1-4096", None, 4, 2, 32, 16),
        ("tinylm GQA 4/2x32, batch 256, ragged 1-1100", None, 4, 2, 32, 16),
        ("32/8x128, batch 1, ctx 3001", [3001], 32, 8, 128, 16),
        ("32/8x128, batch 64, ragged 1-4096", None, 32, 8, 128, 16),
        ("MHA 8/8x64, batch 96, ragged 1-2000, block 32", None, 8, 8, 64, 32),
        ("MQA 16/1x256, batch 8, ragged 1-1500, block 8", None, 16, 1, 256, 8),
        ("GQA 12/4x80 (head not /32), batch 33, ragged 1-700", None, 12, 4, 80, 16),
    ]
    for name, lens, num_heads, num_kv_heads, head_size, block_size in cases:
        if lens is None:
            batch = int(name.split("batch ")[1].split(",")[0])
            top = int(name.split("ragged 1-")[1].split(",")[0].split(" ")[0])
            lens = torch.randint(1, top + 1, (batch,), generator=gen).tolist()
            lens[0], lens[-1] = 1, top  # the extremes always
        for dtype in (torch.float32, torch.float16):
            args = attention_inputs(gen, lens, num_heads, num_kv_heads, head_size, block_size, dtype)
            scale = head_size**-0.5
            want = attention_reference64(*args, block_size, scale)
            variants = (("auto", None, "warp"), ("unsplit", 1 << 30, "warp"), ("256-token partitions", 256, "warp"),
                        ("auto again (fast launch)", None, "warp"), ("tile kernel, auto", None, "tile"))
            case_name = name
            if name.startswith("32/8x128, batch 64"):  # caches 4 (fp32) or 2 (fp16) bytes off 16: narrower loads
                args[1], args[2] = (_misaligned_copy(cache) for cache in args[1:3])
                case_name = name + ", caches misaligned"
            for split_name, partition_size, kernel in variants:
                out = torch.full_like(args[0], float("nan"))
                paged_attention_decode(*args, block_size, scale, out=out, backend="cuda",
                                       partition_size=partition_size, cuda_kernel=kernel)
                torch.cuda.synchronize()
                error = relative_error(out, want)
                results.append(CheckResult("paged_attention_decode", f"{case_name}, {split_name}", str(dtype)[6:],
                                           error, BOUND[dtype], error <= BOUND[dtype]))


def check_windowed_attention(gen: torch.Generator, results: list[CheckResult]) -> None:
    """Sliding windows and softcaps at the shapes of the models that have them, split and unsplit, with
    K/V before each window poisoned with NaN (a kernel that reads one fails)."""
    cases = [  # name, batch, top context, heads, kv heads, head size, window, softcap
        ("Gemma 2 2B 8/4x256, window 4096, cap 50", 16, 8192, 8, 4, 256, 4096, 50.0),
        ("Gemma 3 1B 4/1x256, window 512", 32, 4096, 4, 1, 256, 512, 0.0),
        ("Mistral 7B v0.1 32/8x128, window 4096", 8, 8192, 32, 8, 128, 4096, 0.0),
        ("tinylm-sized 4/2x32, window 1, cap 5", 64, 300, 4, 2, 32, 1, 5.0),
    ]
    block_size = 16
    for name, batch, top, num_heads, num_kv_heads, head_size, window, softcap in cases:
        lens = torch.randint(1, top + 1, (batch,), generator=gen).tolist()
        lens[0], lens[-1] = 1, top
        for dtype in (torch.float32, torch.float16):
            args = attention_inputs(gen, lens, num_heads, num_kv_heads, head_size, block_size, dtype)
            scale = head_size**-0.5
            want = attention_reference64(*args, block_size, scale, window, softcap)
            _poison_before_windows(args[1], args[2], args[3], lens, block_size, window)
            for split_name, partition_size, kernel in (("auto", None, "warp"), ("unsplit", 1 << 30, "warp"),
                                                       ("256-token partitions", 256, "warp"),
                                                       ("tile kernel, auto", None, "tile")):
                out = torch.full_like(args[0], float("nan"))
                paged_attention_decode(*args, block_size, scale, out=out, backend="cuda", partition_size=partition_size,
                                       cuda_kernel=kernel, sliding_window=window, softcap=softcap)
                torch.cuda.synchronize()
                error = relative_error(out, want)
                results.append(CheckResult("paged_attention_decode", f"{name}, {split_name}", str(dtype)[6:], error,
                                           BOUND[dtype], error <= BOUND[dtype]))


def _poison_before_windows(key_cache: torch.Tensor, value_cache: torch.Tensor, tables: torch.Tensor, lens: list[int],
                           block_size: int, window: int) -> None:
    """NaN in every cached K/V slot before each sequence's window. attention_inputs gives each sequence
    blocks of its own, so no slot inside a window is touched."""
    host_tables = tables.cpu()
    slots = [int(host_tables[seq, position // block_size]) * block_size + position % block_size
             for seq, n in enumerate(lens) for position in range(max(0, n - window))]
    if slots:
        index = torch.tensor(slots, dtype=torch.int64, device=key_cache.device)
        for cache in (key_cache, value_cache):
            cache.view(-1, *cache.shape[2:])[index] = float("nan")


def _misaligned_copy(cache: torch.Tensor) -> torch.Tensor:
    """The same values in a contiguous view that starts one element past a 16-byte boundary."""
    flat = torch.empty(cache.numel() + 1, dtype=cache.dtype, device=cache.device)
    view = flat[1:].view(cache.shape)
    view.copy_(cache)
    return view


def check_kv_cache(gen: torch.Generator, results: list[CheckResult]) -> None:
    for num_tokens, num_kv_heads, head_size, block_size in ((8192, 8, 128, 16), (4096, 2, 32, 16), (1, 2, 32, 16)):
        for dtype in (torch.float32, torch.float16):
            num_blocks = -(-num_tokens // block_size) * 2 + 3
            shape = (num_blocks, block_size, num_kv_heads, head_size)
            key = torch.randn((num_tokens, num_kv_heads, head_size), generator=gen).to(dtype).cuda()
            value = torch.randn((num_tokens, num_kv_heads, head_size), generator=gen).to(dtype).cuda()
            slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].cuda()
            slots[:: 97] = -1  # padding tokens
            initial = torch.randn(shape, generator=gen).to(dtype).cuda()
            key_cache, value_cache = initial.clone(), initial.clone()
            write_kv_cache(key, value, key_cache, value_cache, slots, backend="cuda")
            want_key, want_value = initial.clone(), initial.clone()
            keep = slots >= 0
            want_key.view(-1, num_kv_heads, head_size).index_copy_(0, slots[keep], key[keep])
            want_value.view(-1, num_kv_heads, head_size).index_copy_(0, slots[keep], value[keep])
            torch.cuda.synchronize()
            exact = bool(torch.equal(key_cache, want_key) and torch.equal(value_cache, want_value))
            results.append(CheckResult("write_kv_cache", f"{num_tokens} tokens, {num_kv_heads}x{head_size}, "
                                       "every 97th padding (bit-exact)", str(dtype)[6:], 0.0 if exact else 1.0,
                                       0.0, exact))


def check_preprocess(rng: np.random.Generator, results: list[CheckResult]) -> None:
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    for num_images, low, high, out_px in ((64, 64, 512, 224), (256, 8, 64, 32), (3, 1, 3, 224)):
        sizes = rng.integers(low, high + 1, size=(num_images, 2))
        images = [rng.integers(0, 256, (int(h), int(w), 3), dtype=np.uint8) for h, w in sizes]
        want = torch.from_numpy(preprocess_images_reference(images, out_px, out_px, mean, std, np.float32))
        for dtype, bound in ((np.float32, 1e-5), (np.float16, 2e-3)):
            got = preprocess_images(images, out_px, out_px, mean, std, out_dtype=dtype, backend="cuda")
            torch.cuda.synchronize()
            error = relative_error(torch.as_tensor(got).cpu(), want)
            results.append(CheckResult("preprocess_images", f"{num_images} images {low}-{high}px -> {out_px}",
                                       np.dtype(dtype).name, error, bound, error <= bound))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit(2)
    gen = torch.Generator().manual_seed(args.seed)
    results: list[CheckResult] = []
    started = time.perf_counter()
    for name, check in (("paged_attention_decode", lambda: check_attention(gen, results)),
                        ("paged_attention_decode windowed", lambda: check_windowed_attention(gen, results)),
                        ("write_kv_cache", lambda: check_kv_cache(gen, results)),
                        ("preprocess_images", lambda: check_preprocess(np.random.default_rng(args.seed), results))):
        try:
            check()
        except Exception as error:  # recorded as a failure; the other ops still run
            traceback.print_exc()
            results.append(CheckResult(name, f"raised {type(error).__name__}: {error}", "-", float("inf"), 0.0,
                                       False))
    print(f"{'op':<24} {'dtype':<8} {'rel error':>10} {'bound':>8}  case")
    for r in results:
        print(f"{r.op:<24} {r.dtype:<8} {r.relative_error:>10.2e} {r.bound:>8.0e}  {'ok' if r.ok else 'FAIL'} {r.case}")
    failed = [r for r in results if not r.ok]
    from kernels import fast_launch

    print(f"{len(results) - len(failed)}/{len(results)} ok in {time.perf_counter() - started:.1f} s "
          f"on {torch.cuda.get_device_name()}, seed {args.seed}; fast launch in use: {fast_launch.enabled()}")
    write_report(args.output, {"device": torch.cuda.get_device_name(), "seed": args.seed,
                                       "results": [asdict(r) for r in results]})
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
