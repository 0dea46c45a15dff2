"""What one decode step of tinylm costs on one core, by the number of sequences in it.

    .venv/bin/python -m bench.token_path.bench_step_cost [--batches 1 4 8 16 32 48 64] [--runs 3] [--steps 40]

The worker's own `StepExecutor.run` (the model loaded as the worker loads it, 1 torch thread),
no gRPC: each batch size prefills its sequences with a 40-token prompt, then times `--steps`
decode steps. A step has a fixed cost (the layers' kernel launches and Python around them) and a
per-sequence cost, so the per-token figure falls as the batch grows: what a generator worker's
`--max-num-seqs` buys. Prints a table (median of the runs, and every run) and writes
bench/results/step_cost.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from bench.harness.results import RESULTS_DIR, ROOT, write_report
from bench.harness.tables import markdown_table
from bench.token_path.request_level_baseline import load_tinylm
from services.worker.work import RunStep, SamplingParams, SequenceStep

RESULTS_PATH = RESULTS_DIR / "step_cost.json"
PROMPT_LEN = 40


def decode_step_s(executor, batch: int, num_steps: int) -> float:
    """Seconds per decode step of `batch` sequences (CPU time: the step runs on this thread)."""
    blocks_each = -(-(PROMPT_LEN + num_steps + 1) // executor.block_size)
    ids = [1000 + i for i in range(batch)]
    prefill = tuple(SequenceStep(seq_id=seq_id, token_ids=(65,) * PROMPT_LEN, start_position=0,
                                 new_blocks=tuple(range(i * blocks_each, (i + 1) * blocks_each)),
                                 reset_block_table=True, sample=True, sampling=SamplingParams())
                    for i, seq_id in enumerate(ids))
    executor.run(RunStep(step_id=1, seqs=prefill))
    began = time.process_time()
    for step in range(num_steps):
        executor.run(RunStep(step_id=2 + step, seqs=tuple(
            SequenceStep(seq_id=seq_id, token_ids=(66,), start_position=PROMPT_LEN + step, sample=True,
                         sampling=SamplingParams(), num_generated=step + 1) for seq_id in ids)))
    elapsed = time.process_time() - began
    executor.forget(ids)
    return elapsed / num_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32, 48, 64])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    parser.add_argument("--quick", action="store_true", help="one run of batches 1, 8 and 32 (`make bench QUICK=1`)")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.batches = 1, [b for b in args.batches if b in (1, 8, 32)] or args.batches[:1]
    executor, _ = load_tinylm(str(ROOT / "model_repo"), 1)
    decode_step_s(executor, 4, 5)  # warm-up
    runs = {batch: [decode_step_s(executor, batch, args.steps) for _ in range(args.runs)] for batch in args.batches}
    rows = [{"batch": batch, "step_ms": [round(s * 1e3, 3) for s in steps],
             "us_per_token": [round(s * 1e6 / batch, 1) for s in steps],
             "median_us_per_token": round(statistics.median(steps) * 1e6 / batch, 1)} for batch, steps in runs.items()]
    print(markdown_table(["sequences", "CPU per step, ms (every run)", "CPU per token, us (median)", "every run"],
                         [(row["batch"], ", ".join(map(str, row["step_ms"])), str(row["median_us_per_token"]),
                           ", ".join(map(str, row["us_per_token"]))) for row in rows]))
    write_report(args.output, {"load_average_1m": os.getloadavg()[0], "rows": rows})


if __name__ == "__main__":
    main()
