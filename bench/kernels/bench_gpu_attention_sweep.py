"""The warp attention kernel's layouts timed and checked on a GPU, to choose ``layout_for``'s defaults.

    python -m bench.kernels.bench_gpu_attention_sweep [--budget-s 120] [--output bench/results/gpu_attention_sweep.json]

For each shape and dtype (float16, bfloat16, float32): the default layout
(``layout_for``) and the candidates of ``candidate_layouts``, each checked once against a float64
reference (relative error, same bounds as ``bench.kernels.bench_gpu_kernel_check``)
and timed in device time (``bench.kernels.gpu_timing``: launches queued behind
a spin, input sets cycled past L2), beside PyTorch's gather + SDPA on the same
inputs. Stops starting new shapes after ``--budget-s`` seconds, so it fits a
short device lease; rows are printed as they come, then the best layout of each
shape and dtype against the copy bandwidth and PyTorch.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from bench.harness.results import RESULTS_DIR, write_report
from bench.kernels.device import peak_bandwidth_gb_per_s
from bench.kernels.gpu_reference import BOUND, attention_reference64, relative_error
from bench.kernels.gpu_timing import attention_sets, copy_gb_per_s, event_median_ms, gather_sdpa_call
from kernels import paged_attention_decode
from kernels.paged_attention_warp import WarpLayout, layout_for

RESULTS_PATH = RESULTS_DIR / "gpu_attention_sweep.json"
SHAPES = [  # num_seqs, heads, kv heads, head size, context range
    (64, 32, 8, 128, (1024, 2048)),
    (8, 32, 8, 128, (4096, 4096)),
    (256, 4, 2, 32, (1024, 2048)),
    (64, 4, 2, 32, (1024, 2048)),
]


def candidate_layouts(head_size: int, group: int, itemsize: int) -> list[WarpLayout]:
    """The default layout, then the ones it was chosen over (second H200 run, 2026-11-30): for 16-bit formats
    the plain layout (the default before), packed with twice the tokens in flight, packed and prefetching
    without fast math; for float32, fast math (4% faster there, not the default: float32 keeps exact math)."""
    default = layout_for(head_size, group, itemsize)
    if itemsize == 4:
        layouts = [default, replace(default, fastmath=True)]
    else:
        layouts = [default, layout_for(head_size, group, 2, packed=False), layout_for(head_size, group, 2, packed=True),
                   replace(default, fastmath=False)]
    unique: list[WarpLayout] = []
    for layout in layouts:
        try:
            layout.check(head_size, group, itemsize)
        except ValueError:
            continue
        if layout not in unique:
            unique.append(layout)
    return unique


def sweep_shape(num_seqs, num_heads, num_kv_heads, head_size, ctx, dtype, peak, repeats, copy) -> list[dict]:
    sets, moved, width = attention_sets(num_seqs, num_heads, num_kv_heads, head_size, ctx, dtype)
    scale = head_size**-0.5
    want = attention_reference64(*sets[0], 16, scale)
    out = torch.empty_like(sets[0][0])
    group, itemsize = num_heads // num_kv_heads, torch.finfo(dtype).bits // 8
    shape = f"{num_seqs} seqs {num_heads}/{num_kv_heads}x{head_size} ctx {ctx[0]}-{ctx[1]} {str(dtype)[6:]}"
    rows = []
    try:
        sdpa = gather_sdpa_call(sets, width, 16, scale)
        torch_ms = event_median_ms(sdpa, len(sets), repeats, device_only=True)
        torch_error = relative_error(sdpa(0)[:, :, 0, :], want)
        print(f"{shape:<40} torch gather + SDPA {torch_ms:8.4f} ms {moved / (torch_ms * 1e-3) / 1e9:6.0f} GB/s "
              f"err {torch_error:.1e}", flush=True)
    except Exception as exc:  # PyTorch's SDPA without a kernel for this dtype: the sweep goes on
        print(f"{shape} torch gather + SDPA: {type(exc).__name__}: {exc}", flush=True)
        torch_ms = float("nan")
    for layout in candidate_layouts(head_size, group, itemsize):
        def call(i, layout=layout):
            return paged_attention_decode(*sets[i], 16, scale, out=out, backend="cuda", warp_layout=layout)
        try:
            out.fill_(float("nan"))
            call(0)
            error = relative_error(out, want)
            device_ms = event_median_ms(call, len(sets), repeats, device_only=True)
        except Exception as exc:  # one layout that cannot build must not stop the sweep
            print(f"{shape} {layout}: {type(exc).__name__}: {exc}", flush=True)
            continue
        gb = moved / (device_ms * 1e-3) / 1e9
        row = {"shape": shape, "dtype": str(dtype)[6:], "layout": asdict(layout), "device_ms": device_ms,
               "gb_per_s": gb, "of_peak": gb / peak, "of_copy": gb / copy, "torch_device_ms": torch_ms,
               "relative_error": error, "ok": error <= BOUND[dtype],
               "default": layout == layout_for(head_size, group, itemsize)}
        rows.append(row)
        print(f"{shape:<40} L{layout.lanes_per_token:<2} H{layout.heads_per_block} U{layout.tokens_in_flight} "
              f"{'packed ' if layout.packed else '       '}{'prefetch ' if layout.prefetch else '         '}"
              f"{'fast ' if layout.fastmath else '     '}"
              f"{device_ms:8.4f} ms {gb:6.0f} GB/s {gb / copy:4.0%} of copy, torch x{torch_ms / device_ms:4.2f} "
              f"err {error:.1e}{' DEFAULT' if row['default'] else ''}"
              f"{'' if row['ok'] else ' FAIL'}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=120.0)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit(2)
    started = time.perf_counter()
    peak = peak_bandwidth_gb_per_s() or float("nan")
    copy = copy_gb_per_s(10)
    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s, peak {peak:.0f} GB/s", flush=True)
    rows: list[dict] = []
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for num_seqs, num_heads, num_kv_heads, head_size, ctx in SHAPES:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            if time.perf_counter() - started > args.budget_s:
                continue
            try:
                rows += sweep_shape(num_seqs, num_heads, num_kv_heads, head_size, ctx, dtype, peak, args.repeats,
                                    copy)
            except Exception as exc:  # one shape that fails must not lose the others
                print(f"{num_seqs} x {num_heads}/{num_kv_heads}x{head_size} {dtype}: {type(exc).__name__}: {exc}",
                      flush=True)
            torch.cuda.empty_cache()
            write_report(args.output, {"device": torch.cuda.get_device_name(), "copy_gb_per_s": copy,
                                       "peak_gb_per_s": peak, "rows": rows})
    print(f"{len(rows)} layouts, {sum(not r['ok'] for r in rows)} failing, in {time.perf_counter() - started:.0f} s")
    for line in best_lines(rows):
        print(line)


def best_lines(rows: list[dict]) -> list[str]:
    """Per shape: the default's and the fastest correct layout's share of the copy bandwidth, and PyTorch's time."""
    lines = []
    for shape in dict.fromkeys(row["shape"] for row in rows):
        mine = [row for row in rows if row["shape"] == shape and row["ok"]]
        if not mine:
            lines.append(f"BEST {shape}: no correct layout")
            continue
        best = min(mine, key=lambda row: row["device_ms"])
        default = next((row for row in mine if row["default"]), None)
        layout = best["layout"]
        lines.append(
            f"BEST {shape:<40} L{layout['lanes_per_token']} H{layout['heads_per_block']} U{layout['tokens_in_flight']}"
            f"{' packed' if layout['packed'] else ''}{' prefetch' if layout['prefetch'] else ''}"
            f"{' fastmath' if layout['fastmath'] else ''}: "
            f"{best['device_ms']:.4f} ms {best['of_copy']:.0%} of copy; default "
            f"{default['device_ms'] if default else float('nan'):.4f} ms; torch {best['torch_device_ms']:.4f} ms")
    return lines


if __name__ == "__main__":
    main()
