"""The report and table of bench/worker/bench_structured_output.py: its pure parts (no timing here)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from bench.harness.tables import markdown_table

TARGET_RATIO = 0.8  # issue 39: output tokens/s with a JSON schema >= 0.8x without


def summary(values: Sequence[float]) -> dict[str, object]:
    """Every figure (rounded) and their median."""
    return {"runs": [round(v, 4) for v in values], "median": statistics.median(values) if values else None}


def per_token_runs(runs: Sequence[Sequence[float]]) -> dict[str, object]:
    """Per-token microseconds of several runs: each run's median, the median of those, and each run's
    mean (what adds up into a step: the first masks of a matcher and the box's hiccups are in it)."""
    medians = [statistics.median(run) for run in runs if run]
    means = [statistics.fmean(run) for run in runs if run]
    return {"run_medians_us": [round(m, 2) for m in medians],
            "median_us": round(statistics.median(medians), 2) if medians else None,
            "run_means_us": [round(m, 2) for m in means],
            "mean_us": round(statistics.median(means), 2) if means else None,
            "tokens_per_run": [len(run) for run in runs]}


def throughput_section(plain: Sequence[float], schema: Sequence[float]) -> dict[str, object]:
    """Saturated output tokens/s of both phases, and schema's median over plain's against the target."""
    ratio = statistics.median(schema) / statistics.median(plain) if plain and schema else None
    return {"plain": summary(plain), "json_schema": summary(schema), "ratio_of_medians": ratio,
            "target": f">= {TARGET_RATIO}", "met": None if ratio is None else ratio >= TARGET_RATIO}


def stage_per_step(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """The worker's stage seconds per step between two scrapes: {stage: (sum, count)} -> {stage: ms per step}."""
    out = {}
    for stage, (total, count) in after.items():
        total0, count0 = before.get(stage, (0.0, 0.0))
        if count > count0:
            out[stage] = round((total - total0) / (count - count0) * 1e3, 3)
    return out


def stage_ratio(plain: dict[str, float], schema: dict[str, float]) -> dict[str, object]:
    """The ratio the worker's own stages imply, with the box's noise in the forward taken out: both
    phases run the same forwards (same batch, same lengths), so one compute figure (their mean) plus
    each phase's postprocess (sampling, and the grammar's mask and apply): (C + P_plain) / (C + P_schema)."""
    if not all(k in d for d in (plain, schema) for k in ("compute", "postprocess")):
        return {"ratio": None}
    compute = (plain["compute"] + schema["compute"]) / 2
    return {"compute_ms": round(compute, 3), "postprocess_plain_ms": plain["postprocess"],
            "postprocess_schema_ms": schema["postprocess"],
            # What the grammar leaves on the step's critical path: waiting for the masks, the fill,
            # and sampling's extra work on masked rows (the masks themselves run beside the forward).
            "grammar_critical_path_ms": round(schema["postprocess"] - plain["postprocess"], 3),
            "ratio": round((compute + plain["postprocess"]) / (compute + schema["postprocess"]), 3)}


WIDE_MASK = 1000  # a mask allowing more ids than this: inside free text (a string's characters)


def by_mask_width(times_us: Sequence[float], digests: Sequence[str]) -> dict[str, dict[str, object]]:
    """One run's per-token times split by how many ids the mask allowed there (a digest's count,
    mask_digest's "count:hash"): "wide" (more than WIDE_MASK: inside strings) and "narrow"."""
    split: dict[str, list[float]] = {"narrow": [], "wide": []}
    for t, digest in zip(times_us, digests, strict=False):
        split["wide" if int(digest.split(":")[0]) > WIDE_MASK else "narrow"].append(t)
    return {k: {"positions": len(v), "median_us": round(statistics.median(v), 2) if v else None,
                "mean_us": round(statistics.fmean(v), 2) if v else None} for k, v in split.items()}


def engines_section(llguidance_runs: Sequence[dict[str, list[float]]], xgrammar: dict[str, object] | None,
                    skipped: str = "", llguidance_digests: Sequence[str] = ()) -> dict[str, object]:
    """The two engines' mask and advance microseconds per token (per_token_runs of each), side by side,
    and at how many positions their masks allowed the same ids (mask_digest's)."""
    section: dict[str, object] = {"llguidance": {
        "mask": per_token_runs([r["mask_us"] for r in llguidance_runs]),
        "advance": per_token_runs([r["advance_us"] for r in llguidance_runs])}}
    if llguidance_digests:
        section["llguidance"]["mask_by_width_first_run"] = by_mask_width(  # type: ignore[index]
            llguidance_runs[0]["mask_us"], llguidance_digests)
    if xgrammar is None:
        section["xgrammar"] = {"skipped": skipped}
        return section
    runs = xgrammar["runs"]
    assert isinstance(runs, list)
    section["xgrammar"] = {
        "version": xgrammar.get("version"), "tokenizer_s": xgrammar.get("tokenizer_s"),
        "compile_s": xgrammar.get("compile_s"),
        "mask": per_token_runs([r["mask_us"] for r in runs]),
        "advance": per_token_runs([r["advance_us"] for r in runs]),
        "refused_sequences": [r["refused_sequences"] for r in runs],
    }
    if llguidance_digests:  # the positions classed by llguidance's masks, the same for both engines
        section["xgrammar"]["mask_by_width_first_run"] = by_mask_width(runs[0]["mask_us"], llguidance_digests)  # type: ignore[index]
    digests = xgrammar.get("mask_digests") or []
    assert isinstance(digests, list)
    section["same_masks"] = {"positions": len(digests),
                             "equal": sum(a == b for a, b in zip(digests, llguidance_digests, strict=False)),
                             "first_difference": next((f"position {i}: xgrammar {a}, llguidance {b}"
                                                       for i, (a, b) in enumerate(zip(digests, llguidance_digests,
                                                                                      strict=False)) if a != b), None)}
    for figure in ("median_us", "mean_us"):
        llg, xg = section["llguidance"]["mask"][figure], section["xgrammar"]["mask"][figure]  # type: ignore[index]
        section[f"mask_xgrammar_over_llguidance_{figure[:-3]}"] = xg / llg if llg and xg else None
    return section


def table(report: dict) -> str:
    """The report's figures as one Markdown table (what docs quote)."""
    cpu = report["grammar_cpu_per_token"]
    rows: list[tuple[object, ...]] = []
    for sampling, tp in report["saturated_tokens_per_s"].items():
        rows += [(f"{sampling}: plain tok/s (median; runs)", f"{_num(tp['plain']['median'])}; {_runs(tp['plain']['runs'])}"),
                 (f"{sampling}: json_schema tok/s (median; runs)",
                  f"{_num(tp['json_schema']['median'])}; {_runs(tp['json_schema']['runs'])}"),
                 (f"{sampling}: ratio (target >= {TARGET_RATIO})", _num(tp["ratio_of_medians"]))]
        implied = report.get("ratio_from_worker_stages", {}).get(sampling)
        if implied:
            rows.append((f"{sampling}: ratio the worker's stages imply (compute ms/step; postprocess plain, schema)",
                         f"{_num(implied['ratio'])} ({_num(implied.get('compute_ms'))}; "
                         f"{_num(implied.get('postprocess_plain_ms'))}, {_num(implied.get('postprocess_schema_ms'))})"))
            rows.append((f"{sampling}: the grammar on the step's critical path, ms/step (postprocess schema - plain)",
                         _num(implied.get("grammar_critical_path_ms"))))
    rows += [
        ("grammar mask us/token (median; run medians)",
         f"{_num(cpu['mask']['median_us'])}; {_runs(cpu['mask']['run_medians_us'])}"),
        ("grammar apply us/token (median; run medians)",
         f"{_num(cpu['apply']['median_us'])}; {_runs(cpu['apply']['run_medians_us'])}"),
        ("grammar mask + apply us/token, run means",
         _runs([m + a for m, a in zip(cpu["mask"]["run_means_us"], cpu["apply"]["run_means_us"], strict=True)])),
    ]
    for phase, stages in report.get("worker_stage_ms_per_step", {}).items():
        rows.append((f"worker ms/step, {phase}", ", ".join(f"{k} {v}" for k, v in sorted(stages.items())) or "-"))
    engines = report["engines"]
    for engine in ("llguidance", "xgrammar"):
        figures = engines[engine]
        if "skipped" in figures:
            rows.append((f"{engine} mask us/token", f"skipped: {figures['skipped']}"))
            continue
        for part in ("mask", "advance"):
            rows.append((f"{engine} {part} us/token (median; run medians | run means)",
                         f"{_num(figures[part]['median_us'])}; {_runs(figures[part]['run_medians_us'])} | "
                         f"{_runs(figures[part]['run_means_us'])}"))
    for engine in ("llguidance", "xgrammar"):
        width = engines[engine].get("mask_by_width_first_run")
        if width:
            rows.append((f"{engine} mask us/token by mask width, first run (median / mean)",
                         "; ".join(f"{k} ({v['positions']}): {_num(v['median_us'])} / {_num(v['mean_us'])}"
                                   for k, v in width.items())))
    if "same_masks" in engines:
        same = engines["same_masks"]
        rows.append(("positions where both engines' masks allow the same ids", f"{same['equal']} of {same['positions']}"))
    rows.append(("load average (1 min)", _runs(report["load_average_1m"])))
    return markdown_table(("figure", "value"), rows)


def _num(value: object) -> str:
    return "-" if value is None else f"{value:.3g}" if isinstance(value, float) and abs(value) < 10 else (
        f"{value:.0f}" if isinstance(value, float) else str(value))


def _runs(values: Sequence[float]) -> str:
    return ", ".join(_num(float(v)) for v in values)
