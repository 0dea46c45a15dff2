"""What a lone request's compute costs after the process sat idle, against back-to-back.

    .venv/bin/python -m bench.overload.bench_idle_wake_cost [--gaps-ms 0 0.5 5 50] [--samples 60]

The digits worker's own preprocess and model call (loaded as the worker loads it, 1 thread),
timed right after a gap of `--gaps-ms` spent sleeping, or spinning (busy, the core kept), and a
small numpy loop as a control. At 20 requests/s every hop of the mesh (gateway, scheduler,
worker) wakes from ~50 ms of idle for each request; this shows what that alone costs on the box.
Prints a table (medians, us) and writes bench/results/idle_wake_cost.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.harness.results import RESULTS_DIR, ROOT, write_report
from bench.harness.tables import markdown_table

RESULTS_PATH = RESULTS_DIR / "idle_wake_cost.json"


def timed_after(fn: Callable[[], object], gap_s: float, spin: bool, samples: int) -> float:
    """Median microseconds of fn() right after a gap of gap_s (slept, or spun on the CPU)."""
    took = []
    for _ in range(samples):
        if spin:
            until = time.perf_counter() + gap_s
            while time.perf_counter() < until:
                pass
        elif gap_s:
            time.sleep(gap_s)
        began = time.perf_counter()
        fn()
        took.append(time.perf_counter() - began)
    return round(statistics.median(took) * 1e6, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gaps-ms", type=float, nargs="+", default=[0, 0.5, 5, 50])
    parser.add_argument("--samples", type=int, default=60)
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    parser.add_argument("--quick", action="store_true", help="20 samples per gap (`make bench QUICK=1`)")
    args = parser.parse_args()
    if args.quick:
        args.samples = min(args.samples, 20)
    from services.worker.thread_settings import export_thread_env, set_library_threads

    export_thread_env(1)
    set_library_threads(1)
    from services.worker.repository.loader import load_model

    classifier = load_model(str(ROOT / "model_repo"), "digits", "1").classifier
    assert classifier is not None
    image = np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    batch = classifier.preprocess([image])
    matrix = np.random.default_rng(1).random((64, 64))
    work: dict[str, Callable[[], object]] = {
        "preprocess (numba)": lambda: classifier.preprocess([image]),
        "predict (torch)": lambda: classifier.predict_proba(batch),
        "numpy loop (control)": lambda: [float((matrix[i % 64] * 2).sum()) for i in range(200)],
    }
    for fn in work.values():
        timed_after(fn, 0, False, 50)  # warm-up: JIT, allocator pools
    rows = []
    for name, fn in work.items():
        for gap_ms in args.gaps_ms:
            gap_s = gap_ms / 1e3
            rows.append({"work": name, "gap_ms": gap_ms, "slept_us": timed_after(fn, gap_s, False, args.samples),
                         "spun_us": timed_after(fn, gap_s, True, args.samples) if gap_ms else None})
    print(markdown_table(["work", "gap ms", "after sleeping, us", "after spinning, us"],
                         [(row["work"], str(row["gap_ms"]), str(row["slept_us"]), str(row["spun_us"] or "-"))
                          for row in rows]))
    write_report(args.output, {"load_average_1m": os.getloadavg()[0], "rows": rows}, note=f" (load average {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
