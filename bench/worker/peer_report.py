"""bench_hf_llm --peer's report: the mesh against transformers' generate behind HTTP, one request at a
time, both under the same closed-loop levels (its pure parts; no timing here).

Issue 33's target is ">= 5x the output tokens/s at equal p99". A server that takes one request at a
time keeps its tokens/s flat as callers are added while its p99 grows with the queue, so "equal p99"
is read two ways, both reported:

* same load: at each level (the same number of clients, prompts and max_tokens on both sides) where
  the mesh's p99 is no worse than the peer's, the mesh's tokens/s over the peer's;
* strict: the mesh's best tokens/s among its levels whose p99 is within the peer's p99 with one
  client (no queue at the peer), over the peer's single-client tokens/s.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bench.harness.stats import quantile
from bench.harness.tables import markdown_table

TARGET_RATIO = 5.0


@dataclass(frozen=True)
class LevelRun:
    """One closed-loop level on one side: `concurrency` clients, each sending its requests in turn."""

    concurrency: int
    tokens_per_s: float  # output tokens of every request over the level's wall time
    e2e_s: tuple[float, ...]  # every request's seconds, send to last token
    load_average_1m: float  # the box's, as the level began

    @property
    def p99_s(self) -> float:
        return quantile(self.e2e_s, 0.99)  # nearest rank: of a few requests, their largest


def requests_per_client(concurrency: int, requests_at_one: int) -> int:
    """Each client's requests at a level: `requests_at_one` in all at one client, at least one each.
    The peer serves ~27 tokens/s here, so a level of 8 clients x 2 would take it most of a minute."""
    return max(1, -(-requests_at_one // concurrency))


def peer_section(peer: Mapping[int, LevelRun], mesh: Mapping[int, LevelRun]) -> dict[str, object]:
    """Per level both sides' figures and the ratio, then the two readings of "at equal p99"."""
    levels = sorted(peer.keys() & mesh.keys())
    rows = {str(c): _level(peer[c], mesh[c]) for c in levels}
    same_load = {c: mesh[c].tokens_per_s / peer[c].tokens_per_s for c in levels if mesh[c].p99_s <= peer[c].p99_s}
    best_same = max(same_load, key=same_load.__getitem__, default=None)
    single = peer.get(1)
    strict: dict[str, object] = {"peer_concurrency": 1, "target": f">= {TARGET_RATIO:g}"}
    if single is not None:
        within = {c: run.tokens_per_s for c, run in mesh.items() if run.p99_s <= single.p99_s}
        best = max(within, key=within.__getitem__, default=None)
        strict.update({"peer_tokens_per_s": single.tokens_per_s, "peer_e2e_p99_s": single.p99_s,
                       "mesh_best_concurrency": best, "mesh_tokens_per_s": None if best is None else within[best],
                       "ratio": None if best is None else within[best] / single.tokens_per_s})
        strict["met"] = strict["ratio"] is not None and strict["ratio"] >= TARGET_RATIO  # type: ignore[operator]
    return {
        "levels": rows,
        "same_load": {"ratio_by_concurrency": {str(c): r for c, r in same_load.items()},
                      "best_concurrency": best_same,
                      "best_ratio": None if best_same is None else same_load[best_same],
                      "target": f">= {TARGET_RATIO:g}",
                      "met": best_same is not None and same_load[best_same] >= TARGET_RATIO},
        "strict_within_single_client_p99": strict,
    }


def _level(peer: LevelRun, mesh: LevelRun) -> dict[str, object]:
    return {"peer": _side(peer), "mesh": _side(mesh), "tokens_per_s_ratio": mesh.tokens_per_s / peer.tokens_per_s,
            "mesh_p99_within_peer_p99": mesh.p99_s <= peer.p99_s}


def _side(run: LevelRun) -> dict[str, object]:
    return {"tokens_per_s": run.tokens_per_s, "e2e_p99_s": run.p99_s, "load_average_1m": run.load_average_1m,
            "e2e_s": _summary(run.e2e_s)}


def _summary(values: Sequence[float]) -> dict[str, object]:
    return {"runs": [round(v, 4) for v in values], "median": statistics.median(values) if values else None}


def table(section: Mapping[str, object]) -> str:
    """The levels side by side, then both readings, as Markdown."""
    rows = section["levels"]
    assert isinstance(rows, dict)
    lines = markdown_table(
        ("clients", "peer tok/s", "peer p99 s", "mesh tok/s", "mesh p99 s", "mesh / peer tok/s", "mesh p99 <= peer's",
         "load (peer, mesh)"),
        [(c, r["peer"]["tokens_per_s"], r["peer"]["e2e_p99_s"], r["mesh"]["tokens_per_s"], r["mesh"]["e2e_p99_s"],
          r["tokens_per_s_ratio"], "yes" if r["mesh_p99_within_peer_p99"] else "no",
          f"{r['peer']['load_average_1m']:.1f}, {r['mesh']['load_average_1m']:.1f}") for c, r in rows.items()])
    same, strict = section["same_load"], section["strict_within_single_client_p99"]
    assert isinstance(same, dict) and isinstance(strict, dict)
    same_line = ("same load, mesh p99 <= peer p99: none of the levels" if same["best_concurrency"] is None else
                 f"same load, mesh p99 <= peer p99: best {same['best_ratio']:.2f}x at {same['best_concurrency']} "
                 f"clients (target {same['target']})")
    strict_line = ("strict, mesh within the peer's 1-client p99: none of the levels" if strict.get("ratio") is None else
                   f"strict, mesh within the peer's 1-client p99 ({strict['peer_e2e_p99_s']:.2f} s): "
                   f"{strict['ratio']:.2f}x at {strict['mesh_best_concurrency']} clients (target {strict['target']})")
    return "\n".join((lines, "", same_line, strict_line))
