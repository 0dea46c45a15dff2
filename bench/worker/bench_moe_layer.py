"""What one mixture-of-experts layer's experts cost on one core, by the number of tokens in the step:
the worker's forward, each of its two ways of running the rows alone, and two floors.

    .venv/bin/python -m bench.worker.bench_moe_layer [--quick] [--batches 1 8 32 64] [--runs 5] [--repeats 3]

Random float32 weights at three CPU-sized shapes (`SHAPES`), one torch thread as a worker runs, the
tokens routed by a random router as `experts.route` routes them (top k renormalized). Each batch's
routing is fixed, and five ways run over it, one call each a round in a shuffled order:
- `serving`: `experts.grouped_experts`, what the worker runs (it picks one of the next two);
- `loop`: the rows through `experts.per_expert_rows`, a host read of the rows per expert, then a
  Python loop of a few operator calls per chosen expert: the only way before grouped_mm (2d99cfe);
- `grouped_mm`: the rows through `experts.grouped_mm_rows`, two grouped matmuls;
- `flops floor`: the same multiply-adds as one dense matmul pair over the tokens x top_k rows
  through one expert's weights: no routing, and weights that stay in cache;
- `weights floor`: one pass over as many experts' weights as the step chose (a one-row matmul over
  them): the bytes any forward must read from memory, at about the speed memory gives them.
Process CPU per call, the median of a run's `--repeats` rounds; the table gives the median of the runs'
figures, and the JSON every run's. Writes bench/results/moe_layer.json.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from bench.harness.results import RESULTS_DIR, write_report
from bench.harness.tables import markdown_table
from services.worker.models.experts import (
    Activation,
    grouped_experts,
    grouped_mm_rows,
    per_expert_rows,
    route,
)

RESULTS_PATH = RESULTS_DIR / "moe_layer.json"
WAYS = ("serving", "loop", "grouped_mm", "flops floor", "weights floor")
RowsWay = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Shape:
    name: str
    num_experts: int
    top_k: int
    d_model: int
    d_ff: int


SHAPES = (
    Shape("64 experts top-8 (Qwen3-MoE-like)", 64, 8, 1024, 512),
    Shape("128 experts top-8 (Qwen3-30B-A3B / 8)", 128, 8, 256, 96),
    Shape("8 experts top-2 (Mixtral-like)", 8, 2, 512, 1792),
)


def with_rows_way(rows_way: RowsWay) -> Callable[..., torch.Tensor]:
    """`grouped_experts` (the sort, the weighting, the sum) around one fixed way of running the rows."""
    def layer(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor, act: Activation) -> torch.Tensor:
        num_tokens, top_k = experts.shape
        by_expert, order = torch.sort(experts.flatten(), stable=True)
        out = rows_way(x[order // top_k], by_expert, gate_up, down, act)
        weighted = out * weights.flatten()[order, None]
        return weighted[torch.argsort(order)].view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)
    return layer


def layer_ways(shape: Shape, num_tokens: int, seed: int) -> tuple[dict[str, Callable[[], object]], int]:
    """The four ways over one batch's fixed routing, and how many experts it chose."""
    g = torch.Generator().manual_seed(seed)
    e, d, f = shape.num_experts, shape.d_model, shape.d_ff
    gate_up = torch.randn(e, 2 * f, d, generator=g) * d ** -0.5
    down = torch.randn(e, d, f, generator=g) * f ** -0.5
    x = torch.randn(num_tokens, d, generator=g)
    weights, experts = route(F.linear(x, torch.randn(e, d, generator=g)), shape.top_k, renormalize=True,
                             float32_weights=True)
    num_chosen = int(experts.unique().numel())
    rows = x.repeat_interleave(shape.top_k, dim=0)
    one_row, one_hidden_row = x[:1], torch.randn(1, f, generator=g)
    chosen_gate_up, chosen_down = gate_up[:num_chosen].view(-1, d), down[:num_chosen].view(-1, f)

    def flops_floor() -> object:
        gate, up = F.linear(rows, gate_up[0]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down[0])

    def weights_floor() -> object:
        return F.linear(one_row, chosen_gate_up), F.linear(one_hidden_row, chosen_down)

    args = (x, weights, experts, gate_up, down, F.silu)
    return {"serving": lambda: grouped_experts(*args), "loop": lambda: with_rows_way(per_expert_rows)(*args),
            "grouped_mm": lambda: with_rows_way(grouped_mm_rows)(*args),
            "flops floor": flops_floor, "weights floor": weights_floor}, num_chosen


def call_ms(fn: Callable[[], object]) -> float:
    began = time.process_time()
    fn()
    return (time.process_time() - began) * 1e3


def measure(shape: Shape, num_tokens: int, runs: int, repeats: int) -> dict[str, Any]:
    ways, num_chosen = layer_ways(shape, num_tokens, seed=num_tokens)
    for fn in ways.values():
        fn()  # warm-up: first-touch of the weights, allocator
    shuffler = random.Random(num_tokens)
    runs_ms: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(runs):
        calls_ms: dict[str, list[float]] = {way: [] for way in WAYS}
        for _ in range(repeats):
            # A fresh order every round: a way that always ran after another's weights would pay for it.
            for way in shuffler.sample(WAYS, len(WAYS)):
                calls_ms[way].append(call_ms(ways[way]))
        for way, ms in calls_ms.items():
            runs_ms[way].append(round(statistics.median(ms), 3))
    return {"shape": shape.name, "tokens": num_tokens, "experts_chosen": num_chosen,
            "median_ms": {way: statistics.median(ms) for way, ms in runs_ms.items()}, "runs_ms": runs_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one run of 3 calls a way (`make bench QUICK=1`)")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.repeats = 1, 3
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    with torch.inference_mode():
        rows = [measure(shape, n, args.runs, args.repeats) for shape in SHAPES for n in args.batches]
    print(markdown_table(
        ["shape", "tokens", "experts chosen", *(f"{way}, ms" for way in WAYS), "loop / serving"],
        [(r["shape"], r["tokens"], r["experts_chosen"], *(r["median_ms"][way] for way in WAYS),
          f"{r['median_ms']['loop'] / r['median_ms']['serving']:.2f}x") for r in rows]))
    load_after = os.getloadavg()[0]
    print(f"load average (1 min) {load_before:.2f} before, {load_after:.2f} after")
    write_report(RESULTS_PATH, {"runs": args.runs, "repeats": args.repeats, "torch_threads": 1,
                                "load_average_1m": [load_before, load_after], "rows": rows})


if __name__ == "__main__":
    main()
