"""bench_gpu_llm's pure parts: greedy agreement with the CPU, latency summaries, and the tables it
prints last (no timing, no torch here)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bench.harness.stats import quantile
from bench.harness.tables import aligned_table


@dataclass(frozen=True)
class Divergence:
    """Where a device's greedy stream first leaves the CPU's, and how close the CPU's call was there."""

    prompt_index: int
    at: int  # index of the first differing generated token
    cpu_margin: float  # the CPU's top-1 minus top-2 logit at that token (float32): a near tie flips easily
    cpu_gap_to_device_pick: float  # the CPU's top-1 logit minus its logit of the token the device chose


def first_divergence(reference: Sequence[int], candidate: Sequence[int]) -> int | None:
    """Index of the first token where the two streams differ (a shorter one differs where it ends);
    None when they are equal."""
    for i, (a, b) in enumerate(zip(reference, candidate, strict=False)):
        if a != b:
            return i
    return None if len(reference) == len(candidate) else min(len(reference), len(candidate))


def agreement(reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]],
              divergences: Sequence[Divergence], near_tie: float) -> dict[str, Any]:
    """How far a device's greedy streams follow the CPU's: identical streams, the share of tokens generated
    before each stream's first divergence, and every divergence, those whose CPU margin is at least
    `near_tie` listed apart (not explained by a near tie)."""
    num_tokens = sum(len(r) for r in reference)
    agreed = sum(len(r) if (at := first_divergence(r, c)) is None else at
                 for r, c in zip(reference, candidate, strict=True))
    return {
        "num_streams": len(reference),
        "identical_streams": sum(first_divergence(r, c) is None for r, c in zip(reference, candidate, strict=True)),
        "tokens_before_first_divergence_fraction": agreed / num_tokens if num_tokens else math.nan,
        "near_tie_logit_margin": near_tie,
        "divergences": [asdict(d) for d in divergences],
        "not_near_ties": [asdict(d) for d in divergences if d.cpu_margin >= near_tie],
    }


def latency_summary(values_s: Sequence[float]) -> dict[str, float]:
    """p50, p99 (nearest rank: of a few samples, their largest) and mean, in milliseconds."""
    return {"p50_ms": quantile(values_s, 0.5) * 1e3, "p99_ms": quantile(values_s, 0.99) * 1e3,
            "mean_ms": statistics.fmean(values_s) * 1e3 if values_s else math.nan, "n": len(values_s)}


def tpot_s(ttft_s: float, e2e_s: float, num_tokens: int) -> float:
    """Time per output token after the first: NaN for a stream of one token."""
    return (e2e_s - ttft_s) / (num_tokens - 1) if num_tokens > 1 else math.nan


def row_key(row: Mapping[str, Any]) -> str:
    """A step row's line: model, device, dtype, and "graphed" for a decode graph's rows."""
    key = f"{row['model']} {row['device']} {row['dtype']}"
    return key + " graphed" if row.get("path") == "graph" else key


def steps_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Step milliseconds, one line per (model, device, dtype, graphed or not) and a column per decode
    batch size, the prefill chunk last."""
    batches = sorted({r["batch"] for r in rows if r["kind"] == "decode"})
    prefills = sorted({r["tokens"] for r in rows if r["kind"] == "prefill"})
    lines: dict[str, dict[str, str]] = {}
    for r in rows:
        cells = lines.setdefault(row_key(r), {})
        column = f"b={r['batch']}" if r["kind"] == "decode" else f"prefill {r['tokens']}"
        cells[column] = f"{r['step_ms']:.2f}"
    columns = [f"b={b}" for b in batches] + [f"prefill {n}" for n in prefills]
    context = {r["context"] for r in rows if r["kind"] == "decode"}
    header = [f"step ms (decode at {'/'.join(map(str, sorted(context)))})", *columns]
    return aligned_table(header, [[key, *(cells.get(c, "-") for c in columns)]
                                  for key, cells in lines.items()])


def peak_decode(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Each line's (model, device, dtype, graphed or not) best decode tokens/s over its batch sizes."""
    best: dict[str, float] = {}
    for r in rows:
        if r["kind"] == "decode":
            key = row_key(r)
            best[key] = max(best.get(key, 0.0), r["tokens_per_s"])
    return best


def mesh_table(mesh: Mapping[str, Any]) -> str:
    """The mesh against one process: saturated tokens/s and the light rate's TTFT and TPOT."""
    sat, light = mesh["saturated"], mesh["light"]

    def row(name: str, mesh_value: float, one_value: float, ratio: float) -> list[str]:
        return [name, f"{mesh_value:.1f}", f"{one_value:.1f}", f"{ratio:.2f}"]

    rows = [row(f"tokens/s, {sat['streams']} streams x {sat['tokens_per_stream']}", sat["mesh_tokens_per_s"],
                sat["one_process_tokens_per_s"], sat["ratio_mesh_over_one_process"])]
    for metric in ("ttft", "tpot"):
        for q in ("p50", "p99"):
            rows.append(row(f"{metric.upper()} {q} ms, one at a time", light["mesh"][metric][f"{q}_ms"],
                            light["one_process"][metric][f"{q}_ms"], light["ratios_mesh_over_one_process"][f"{metric}_{q}"]))
    return aligned_table([f"mesh ({mesh['compute_dtype']})", "mesh", "one process", "mesh / one"], rows)


def graphs_table(graphs: Mapping[str, Any]) -> str:
    """The mesh's worker with decode graphs off and on: tokens/s, TTFT and TPOT, and identical streams."""
    off, on = graphs["off"], graphs["on"]

    def row(name: str, off_value: float, on_value: float) -> list[str]:
        return [name, f"{off_value:.1f}", f"{on_value:.1f}", f"{on_value / off_value:.2f}" if off_value else "-"]

    rows = [row(f"tokens/s, {graphs['streams']} streams x {graphs['tokens_per_stream']}", off["tokens_per_s"],
                on["tokens_per_s"])]
    for metric in ("ttft", "tpot"):
        for q in ("p50", "p99"):
            rows.append(row(f"{metric.upper()} {q} ms, one at a time", off[metric][f"{q}_ms"], on[metric][f"{q}_ms"]))
    rows.append(row("worker start s", off["worker_start_s"], on["worker_start_s"]))
    burst, light = graphs["burst_streams_identical"], graphs["light_streams_identical"]
    same = (f"  greedy streams identical off vs on: burst {burst['identical']}/{burst['streams']}, one at a time "
            f"{light['identical']}/{light['streams']}")
    logged = graphs["worker_log"]["on"]
    return "\n".join([aligned_table(["mesh, cuda graphs", "off", "on", "on / off"], rows), same,
                      "  worker (on): " + (logged[-1].strip() if logged else "logged nothing about CUDA graphs")])
