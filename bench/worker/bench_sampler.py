"""The worker's sampler per step: 16 sequences x a 32 000-token vocabulary (issue 33's medium Llama), the
process CPU of sampling every row once, greedy and at temperature > 0 with and without a top_p cut.

    .venv/bin/python -m bench.worker.bench_sampler [--quick] [--repeats N]

Process CPU (not wall time), so another process on a shared box slows it less; the median of
`--repeats` steps per case. Logits are float32 rows N(0, spread^2) at two spreads: 2 (a peaked
distribution: a top_p cut keeps a few hundred tokens) and 0.02 (the random-weight model's nearly flat
one: a cut keeps most of the vocabulary). Prints a table; writes bench/results/sampler.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from bench.harness.results import RESULTS_DIR, write_report
from bench.harness.tables import markdown_table
from services.worker.sampling import sample
from services.worker.work import SamplingParams

NUM_SEQS, VOCAB = 16, 32000
CASES = {
    "greedy": SamplingParams(),
    "temperature 0.8": SamplingParams(temperature=0.8),
    "temperature 0.8, top_p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "temperature 0.8, top_p 0.5": SamplingParams(temperature=0.8, top_p=0.5),
}
SPREADS = (2.0, 0.02)


def step_cpu_ms(rows: np.ndarray, params: SamplingParams, repeats: int) -> list[float]:
    """Process CPU milliseconds to sample every row once, `repeats` times (each step its own positions)."""
    times = []
    for step in range(repeats):
        began = time.process_time()
        for i, row in enumerate(rows):
            sample(row, params, seed=7, index=step * len(rows) + i)
        times.append((time.process_time() - began) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 steps per case")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    repeats = 5 if args.quick else args.repeats
    rng = np.random.default_rng(0)
    figures: dict[str, dict[str, object]] = {}
    for spread in SPREADS:
        rows = (rng.standard_normal((NUM_SEQS, VOCAB)) * spread).astype(np.float32)
        for name, params in CASES.items():
            times = step_cpu_ms(rows, params, repeats)
            figures[f"{name}; spread {spread:g}"] = {"median_ms": statistics.median(times),
                                                    "runs_ms": [round(t, 3) for t in times]}
    report = {"rows": NUM_SEQS, "vocab": VOCAB, "repeats": repeats, "load_average_1m": os.getloadavg()[0],
              "cpu_ms_per_step": figures}
    write_report(RESULTS_DIR / "sampler.json", report)
    print(markdown_table(("case", "CPU ms per step (median)"), [(k, v["median_ms"]) for k, v in figures.items()]))
    print(f"load average {report['load_average_1m']:.2f}")


if __name__ == "__main__":
    main()
