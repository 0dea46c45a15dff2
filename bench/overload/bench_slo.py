"""Goodput under latency objectives: admission on predicted TTFT vs deadlines alone, in the same run.

    .venv/bin/python -m bench.overload.bench_slo [--quick] [--generators mock,tinylm] [--placement shared|pinned]
        [--admit-ttft-ms interactive=60] [--output PATH] [--streams-csv PATH]

For each generator (a mock whose step takes step_ms + per_token_us x tokens, so it grows with the
batch as a GPU's does; tinylm on CPU), starts a scheduler, one worker and two gateways on the same
scheduler: one admitting on predicted TTFT (the default) and one with --slo-admission false
(deadlines alone). Streams are two classes mixed 1:1: interactive (tenant gen-critical, TTFT 200
ms, TPOT 50 ms) and batch (tenant gen-sheddable, TTFT 5 s, TPOT 1 s); each request carries its
targets in GenerateRequest.objectives. The peak is the streams/s 48 closed-loop interactive clients
complete through the deadline-only gateway. Then 0.5x, 1x, 2x and 4x the peak are offered open-loop
(Poisson) to each gateway in turn. Goodput (DistServe): streams meeting both of their targets per
second, TTFT measured from the scheduled send time, TPOT as (end - first token) / (tokens - 1).
The gateways' smoothed predicted and measured TTFT per class (infermesh_gateway_objective_ttft_seconds)
are read at the end of each window: the predictor's error.

--placement pinned puts the worker on a core of its own and every other process (gateways, scheduler,
load generator, this one) on the rest, as a GPU keeps the worker's compute off the front end's cores
(bench/overload/placement.py); the default, shared, lets every process run anywhere. Report a pinned
figure beside the shared one, never instead of it, and name its placement.

--admit-ttft-ms CLASS=MS[,...] makes a class's streams send a TTFT target other than the one they are
judged at (interactive=60: admission judges each interactive stream against 60 ms, while goodput, the
TTFT p99 and the predictor's error are still judged at the issue's 200 ms): what a queue budget tighter
than the objective would buy and cost (issue 36). Each window counts the streams refused with a
prediction within the judged target (`refused_predicted_within_judged`): refused by the budget alone.

--streams-csv writes every measured stream (generator, multiple, gateway, class, when it was scheduled,
status, TTFT from the send, the gateway's prediction, the refusal's message), to study the predictor beyond
its medians and why streams were refused.

Prints a table and writes bench/results/overload_slo.json (a setting off the default in the name:
overload_slo_pinned.json, overload_slo_1procs.json). The box is shared: say so with figures.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import re
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bench.harness.load_plan import RequestTemplate, Rpc, Stream
from bench.harness.load_pool import ClosedLoopJob, LoadPool
from bench.harness.mesh_ready import WORKER_ENV, wait_attached
from bench.harness.results import MODEL_REPO, RESULTS_DIR, finite, write_report
from bench.harness.send_result import SendResult
from bench.harness.stats import quantile
from bench.harness.stop_signal import exit_on_sigterm
from bench.overload import placement
from bench.overload.bench_overload import (
    KEYS,
    MAX_LOAD_PROCS,
    QUICK,
    TENANTS_PATH,
    Bench,
    Profile,
    _commit,
    cpu_seconds,
)
from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2, scheduler_pb2_grpc
from loadtest.confidence import percentile_interval
from loadtest.payloads import make_prompt
from tools.testbed.processes import ServiceProcess, free_port, running_mesh

RESULTS_PATH = RESULTS_DIR / "overload_slo.json"
MULTIPLES = (0.5, 1.0, 2.0, 4.0)
CLOSED_LOOP_CLIENTS = 48


@dataclass(frozen=True)
class StreamClass:
    name: str
    tenant: str
    ttft_ms: int
    tpot_ms: int
    deadline_s: float


INTERACTIVE = StreamClass("interactive", "gen-critical", 200, 50, 5.0)
BATCH = StreamClass("batch", "gen-sheddable", 5000, 1000, 30.0)
GENERATORS = {
    # model name, worker flags
    "mock": ("mock-generator", ("--mock-profile", "step_ms=10,per_token_us=200,max_num_seqs=32,num_kv_blocks=2048")),
    "tinylm": ("tinylm", ("--model-repository", str(MODEL_REPO), "--max-num-seqs", "32")),
}


def parse_admit_ttft(text: str) -> dict[str, int]:
    """`interactive=60,batch=2000` -> the TTFT (ms) each named class sends instead of its judged target."""
    out: dict[str, int] = {}
    names = {c.name for c in (INTERACTIVE, BATCH)}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name.strip() not in names:
            raise ValueError(f"--admit-ttft-ms: expected CLASS=MS with CLASS one of {', '.join(sorted(names))}, "
                             f"got {item!r}")
        try:
            ms = int(value)
        except ValueError:
            raise ValueError(f"--admit-ttft-ms: {name.strip()}'s TTFT must be a whole number of ms, "
                             f"got {value!r}") from None
        if ms <= 0:
            raise ValueError(f"--admit-ttft-ms: {name.strip()}'s TTFT must be > 0 ms, got {ms}")
        out[name.strip()] = ms
    return out


# What a refusal on predicted TTFT says it predicted (latency_admission.check_ttft's message).
_REFUSED_PREDICTION = re.compile(r"would start a \w+ stream in ([0-9.]+) ms at best(?: after ([0-9.]+) ms before)?")


def refused_within(results: list[SendResult], target_ms: float) -> int:
    """Streams refused on a predicted TTFT (plus their wait before the gateway) within `target_ms`: refused
    by a budget tighter than the target they are judged at, where admission at that target would have taken
    them (by the prediction, so an estimate of what the budget costs)."""
    count = 0
    for r in results:
        found = _REFUSED_PREDICTION.search(r.message) if r.status == "RESOURCE_EXHAUSTED" else None
        count += found is not None and float(found.group(1)) + float(found.group(2) or 0) <= target_ms
    return count


def templates(model: str, cls: StreamClass, seed: int, num: int = 300,
              admit_ttft_ms: int | None = None) -> tuple[RequestTemplate, ...]:
    """Greedy, EOS ignored, prompts of 8-48 bytes, max_tokens 8-64, the class's targets in the request
    (`admit_ttft_ms`: a TTFT target to send instead of the class's, which the benchmark still judges at)."""
    rng = np.random.default_rng([seed, 17])
    out = []
    for i in range(num):
        request = gateway_pb2.GenerateRequest(
            model=common_pb2.ModelRef(name=model), prompt=make_prompt(int(rng.integers(8, 49)), rng),
            sampling=common_pb2.SamplingParams(max_tokens=int(rng.integers(8, 65)), temperature=0.0, ignore_eos=True,
                                               seed=i),
            objectives=gateway_pb2.LatencyObjectives(ttft_ms=admit_ttft_ms or cls.ttft_ms, tpot_ms=cls.tpot_ms))
        out.append(RequestTemplate(Rpc.GENERATE, request.SerializeToString(), KEYS[cls.tenant], cls.name,
                                   cls.deadline_s))
    return tuple(out)


def misses(result: SendResult, cls: StreamClass) -> str:
    """What a served stream missed: "" (met both), "ttft", "tpot" or "both"."""
    assert result.ttft_s is not None
    tpot_s = (result.latency_s - result.ttft_s) / (result.num_tokens - 1) if result.num_tokens > 1 else 0.0
    missed = [name for name, late in (("ttft", result.ttft_s * 1000 > cls.ttft_ms),
                                      ("tpot", tpot_s * 1000 > cls.tpot_ms)) if late]
    return "both" if len(missed) == 2 else "".join(missed)


def meets(result: SendResult, cls: StreamClass) -> bool:
    return result.ok and result.ttft_s is not None and not misses(result, cls)


def refusal_reasons(results: list[SendResult]) -> dict[str, int]:
    """Failures by status and the start of their message, numbers blanked: who refused, and why."""
    reasons = Counter(f"{r.status}: {re.sub(r'[0-9.]+', '#', r.message)[:110]}" for r in results if not r.ok)
    return dict(reasons.most_common())


def summarize(results: list[SendResult], window_s: float) -> dict:
    out: dict = {"num_streams": len(results), "goodput_per_s": 0.0}
    for cls in (INTERACTIVE, BATCH):
        mine = [r for r in results if r.tenant == cls.name]
        ttft_ms = [1000 * r.ttft_s for r in mine if r.ok and r.ttft_s is not None]
        good = sum(meets(r, cls) for r in mine)
        out[cls.name] = {"offered": len(mine), "ok": sum(r.ok for r in mine),
                         "refused": sum(r.status == "RESOURCE_EXHAUSTED" for r in mine),
                         "refused_predicted_within_judged": refused_within(mine, cls.ttft_ms),
                         "other_errors": sum(not r.ok and r.status != "RESOURCE_EXHAUSTED" for r in mine),
                         "met_both": good, "goodput_per_s": good / window_s,
                         "missed": dict(Counter(misses(r, cls) or "none" for r in mine if r.ok and r.ttft_s is not None)),
                         "failures": refusal_reasons(mine),
                         "ttft_p50_ms": quantile(ttft_ms, 0.5), "ttft_p99_ms": quantile(ttft_ms, 0.99),
                         # 95% interval of that p99 (exact percentile bootstrap): a quick window's ~100
                         # interactive streams at 0.5x put its p99 on one or two of them.
                         "ttft_p99_ci_ms": p99_interval_ms(ttft_ms),
                         # How late the load generator sent (counted in TTFT: open loop), and TTFT without it.
                         "send_lag_p99_ms": quantile([1000 * r.lag_s for r in mine], 0.99),
                         "ttft_from_send_p99_ms": quantile(
                             [1000 * (r.ttft_s - r.lag_s) for r in mine if r.ok and r.ttft_s is not None], 0.99),
                         "predictor": predictor_error(mine, cls)}
        out["goodput_per_s"] += good / window_s
    return out


def predictor_error(results: list[SendResult], cls: StreamClass) -> dict:
    """The admission predictor's error over the window's measured streams, each against its own prediction
    (GenerateResponse.predicted_ttft_us): |TTFT from the send - predicted|. The same streams as every other
    figure of the window (after its warm-up), where the gateway's error histogram counts every stream that
    ended in the window, warm-up included. The TTFT here includes the gateway's ingress and the transport,
    which the prediction leaves out: a little stricter than the histogram's."""
    errors_ms = [1000 * abs(r.ttft_s - r.lag_s - r.predicted_ttft_s) for r in results
                 if r.ok and r.ttft_s is not None and r.predicted_ttft_s is not None]
    if not errors_ms:
        return {"num_streams": 0, "median_abs_error_ms": None, "median_abs_error_of_target": None,
                "p90_abs_error_ms": None}
    median_ms = quantile(errors_ms, 0.5)
    return {"num_streams": len(errors_ms), "median_abs_error_ms": median_ms,
            "median_abs_error_of_target": median_ms / cls.ttft_ms, "p90_abs_error_ms": quantile(errors_ms, 0.9)}


def p99_interval_ms(values_ms: list[float]) -> list[float] | None:
    """The 95% interval of the values' p99 (loadtest/confidence.py); None when there are none."""
    if not values_ms:
        return None
    return list(percentile_interval(np.sort(np.asarray(values_ms, dtype=np.float64)), 99.0))


def ratio_interval(high: list[float] | None, low: list[float] | None) -> list[float] | None:
    """The range of high / low when each lies anywhere in its interval (both positive); None if unknown."""
    if not high or not low or low[0] <= 0 or low[1] <= 0:
        return None
    return [high[0] / low[1], high[1] / low[0]]


def window_cpu(before: dict[str, float], after: dict[str, float], elapsed_s: float, send_cpu_us: float) -> dict:
    """Cores each process used over a window (its warm-up and drain included), and the load processes' CPU
    per stream sent (`send_cpu_us`): where the time goes when the box, not the worker, runs out."""
    return {"cores": {name: round((after[name] - before[name]) / elapsed_s, 3) for name in after if name in before},
            "load_send_cpu_us_per_stream": round(send_cpu_us, 1)}


def histogram_buckets(metrics_port: int, family_name: str) -> dict[str, dict[float, float]]:
    """A histogram's cumulative counts per priority class (le -> count) at a process's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    out: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name == family_name:
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    buckets = out.setdefault(sample.labels["priority"], {})
                    le = float(sample.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + sample.value  # summed over the other labels (model)
    return out


def ttft_error_buckets(metrics_port: int) -> dict[str, dict[float, float]]:
    """The gateway's per-stream |measured - predicted| TTFT histogram per class: le -> cumulative count."""
    return histogram_buckets(metrics_port, "infermesh_gateway_objective_ttft_error_seconds")


def queue_time_buckets(metrics_port: int) -> dict[str, dict[float, float]]:
    """The scheduler's queue time per class (arrival until a sequence's first step is scheduled)."""
    return histogram_buckets(metrics_port, "infermesh_scheduler_queue_time_seconds")


def median_from_buckets(before: dict[float, float], after: dict[float, float]) -> float | None:
    """The median of what a window added to a cumulative histogram, interpolated inside its bucket; None: empty."""
    return quantile_from_buckets(before, after, 0.5)


def quantile_from_buckets(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """The q-quantile of what a window added to a cumulative histogram, interpolated inside its bucket (the
    last finite edge when it falls in the +Inf bucket); None: empty."""
    edges = sorted(after)
    counts = [after[le] - before.get(le, 0.0) for le in edges]
    if not counts or counts[-1] <= 0:
        return None
    rank, lower, below = counts[-1] * q, 0.0, 0.0
    for le, count in zip(edges, counts, strict=True):
        if count >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (rank - below) / max(count - below, 1e-9)
        lower, below = le, count
    return None


def share_over(before: dict[float, float], after: dict[float, float], edge_s: float) -> float | None:
    """The share of what a window added to a cumulative histogram that lies above the bucket edge `edge_s`."""
    total = after.get(float("inf"), 0.0) - before.get(float("inf"), 0.0)
    if total <= 0 or edge_s not in after:
        return None
    return 1.0 - (after[edge_s] - before.get(edge_s, 0.0)) / total


def ttft_gauges(metrics_port: int) -> dict[str, float]:
    """The gateway's smoothed predicted / measured TTFT per class, ms."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "infermesh_gateway_objective_ttft_seconds":
            for sample in family.samples:
                out[f"{sample.labels['priority']}_{sample.labels['source']}_ms"] = 1000 * sample.value
    return out


@contextmanager
def mesh(generator: str) -> Iterator[dict]:
    model, worker_args = GENERATORS[generator]
    with tempfile.TemporaryDirectory(prefix="bench-slo-") as tmp, running_mesh(Path(tmp), tls=False) as m:
        scheduler_metrics = free_port()
        m.start_scheduler("--log-level", "WARNING", "--metrics-port", str(scheduler_metrics))
        m.start_worker(model, "--log-level", "WARNING", *worker_args, env=WORKER_ENV)
        wait_attached(m.scheduler.address, 1)
        slo_metrics, deadline_metrics = free_port(), free_port()
        common = ("--tenants-file", str(TENANTS_PATH), "--log-level", "WARNING", "--pressure-poll-interval-ms", "100")
        m.start_gateway(*common, "--metrics-port", str(slo_metrics))
        port = free_port()
        deadline_only = ServiceProcess("gateway-deadline", "gateway", port,
                                       ["--scheduler-address", m.scheduler.address, *common,
                                        "--metrics-port", str(deadline_metrics), "--slo-admission", "false"],
                                       dict(m.env), Path(tmp) / "gateway-deadline.log", tls=False)
        m.processes.append(deadline_only.start())
        deadline_only.wait_serving()
        for address in (m.gateway.address, deadline_only.address):
            _wait_serves(address, templates(model, INTERACTIVE, 0, 1)[0])
        yield {"model": model, "scheduler": m.scheduler.address, "scheduler_metrics": scheduler_metrics,
               "slo": (m.gateway.address, slo_metrics),
               "deadline": (deadline_only.address, deadline_metrics),
               "pids": {p.name: p.proc.pid for p in m.processes}}


def wait_drained(scheduler_address: str, timeout_s: float = 60.0) -> float:
    """Until the scheduler holds no sequence (none queued, no KV block in use), so a window starts on an
    empty mesh, not on the last one's backlog; the seconds it took."""
    began = time.monotonic()
    with grpc.insecure_channel(scheduler_address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        while time.monotonic() - began < timeout_s:
            reply = stub.GetPressure(scheduler_pb2.GetPressureRequest(), timeout=5)
            if all(m.queue_depth == 0 and m.kv_usage == 0 for m in reply.models):
                return time.monotonic() - began
            time.sleep(0.1)
    raise TimeoutError(f"scheduler {scheduler_address} still busy after {timeout_s} s")


def _wait_serves(address: str, template: RequestTemplate, timeout_s: float = 60.0) -> None:
    give_up = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        generate = channel.unary_stream("/infermesh.v1.Inference/Generate")
        while True:
            try:
                list(generate(template.body, timeout=10, metadata=(("authorization", f"Bearer {template.api_key}"),)))
                return
            except grpc.RpcError as err:
                if time.monotonic() > give_up:
                    raise TimeoutError(f"gateway {address} did not serve: {err.code().name}") from err
                time.sleep(0.2)


def place(where: placement.Placement, pids: dict[str, int], pool: LoadPool) -> dict:
    """Applies the placement to the mesh's processes, the load processes and this one; what is in force."""
    workers = [pid for name, pid in pids.items() if name.startswith("worker")]
    others = [pid for name, pid in pids.items() if not name.startswith("worker")]
    done = placement.apply(where, workers, [*others, *pool.pids.values(), os.getpid()])
    return {**done, "cores": placement.describe({**pids, **pool.pids})}


STREAM_COLUMNS = ("generator", "multiple", "gateway", "class", "scheduled_s", "status", "ttft_from_send_ms",
                  "predicted_ttft_ms", "num_tokens", "message")


def stream_rows(generator: str, multiple: float, gateway: str, results: list[SendResult]) -> list[tuple]:
    """One row per stream (STREAM_COLUMNS); TTFT and prediction empty where there is none."""
    def ms(seconds: float | None) -> str:
        return "" if seconds is None else f"{1000 * seconds:.1f}"
    return [(generator, multiple, gateway, r.tenant, f"{r.scheduled_s:.3f}", r.status,
             ms(None if r.ttft_s is None else r.ttft_s - r.lag_s), ms(r.predicted_ttft_s), r.num_tokens, r.message)
            for r in results]


def run_generator(generator: str, pool: LoadPool, profile: Profile, multiples: tuple[float, ...],
                  where: placement.Placement = placement.Placement.SHARED,
                  streams: list[tuple] | None = None, admit_ttft_ms: dict[str, int] | None = None) -> dict:
    admit = admit_ttft_ms or {}
    with mesh(generator) as started:
        model = started["model"]
        placed = place(where, started["pids"], pool)
        print(f"{generator}: placement {where.value} " + " ".join(f"{k} {v}" for k, v in placed["cores"].items()),
              flush=True)
        interactive = templates(model, INTERACTIVE, 1, admit_ttft_ms=admit.get(INTERACTIVE.name))
        batch = templates(model, BATCH, 2, admit_ttft_ms=admit.get(BATCH.name))
        benches = {name: Bench(started[name][0], pool, profile, started["pids"]) for name in ("slo", "deadline")}
        job = ClosedLoopJob(interactive, CLOSED_LOOP_CLIENTS, 1.0 + profile.capacity_s)
        results, _ = pool.closed_loop(started["deadline"][0], job)
        peak_per_s = sum(r.ok and r.done_s >= 1.0 for r in results) / profile.capacity_s
        print(f"{generator}: peak {peak_per_s:.1f} streams/s (closed loop, deadline-only gateway)", flush=True)
        out: dict = {"peak_per_s": peak_per_s, "placement": placed, "multiples": {}}
        window_s = profile.warmup_s + profile.generate_s
        for multiple in multiples:
            rate_per_s = multiple * peak_per_s
            row = {}
            # Interleaved: which gateway goes first alternates, so neither always runs on a hotter box.
            order = list(benches) if len(out["multiples"]) % 2 == 0 else list(reversed(benches))
            for name in order:
                bench = benches[name]
                row.setdefault("drain_s", {})[name] = wait_drained(started["scheduler"])
                errors_before = ttft_error_buckets(started[name][1])
                queue_before = queue_time_buckets(started["scheduler_metrics"])
                cpu_before, began = cpu_seconds({**started["pids"], **pool.pids}), time.monotonic()
                results = bench.replay([Stream(interactive, rate_per_s / 2, window_s),
                                        Stream(batch, rate_per_s / 2, window_s)])
                row[name] = summarize(results, profile.generate_s)
                if streams is not None:
                    streams.extend(stream_rows(generator, multiple, name, results))
                row[name]["cpu"] = window_cpu(cpu_before, cpu_seconds({**started["pids"], **pool.pids}),
                                              time.monotonic() - began, bench.send_cpu_us_per_request)
                row[name]["gauges"] = ttft_gauges(started[name][1])
                errors_after = ttft_error_buckets(started[name][1])
                queue_after = queue_time_buckets(started["scheduler_metrics"])
                for cls, priority in ((INTERACTIVE, "critical"), (BATCH, "sheddable")):
                    median_s = median_from_buckets(errors_before.get(priority, {}), errors_after.get(priority, {}))
                    row[name][cls.name]["ttft_error_median_ms"] = None if median_s is None else 1000 * median_s
                    row[name][cls.name]["ttft_error_median_of_target"] = (
                        None if median_s is None else 1000 * median_s / cls.ttft_ms)
                    row[name][cls.name]["scheduler_queue"] = scheduler_queue(
                        queue_before.get(priority, {}), queue_after.get(priority, {}))
                row[name]["load_average_1m"] = os.getloadavg()[0]
                print(f"  {multiple}x ({rate_per_s:.1f}/s) {name}: goodput {row[name]['goodput_per_s']:.2f}/s, "
                      f"interactive TTFT p99 {row[name]['interactive']['ttft_p99_ms']:.0f} ms, "
                      f"refused {row[name]['interactive']['refused']}+{row[name]['batch']['refused']} "
                      f"({row[name]['interactive']['refused_predicted_within_judged']} interactive predicted "
                      f"within {INTERACTIVE.ttft_ms} ms), "
                      f"TTFT median abs error {_predictor(row[name]['interactive']['predictor'])} / "
                      f"{_predictor(row[name]['batch']['predictor'])} ms (whole window incl. warm-up, gateway "
                      f"histogram: {_ms(row[name]['interactive']['ttft_error_median_ms'])} / "
                      f"{_ms(row[name]['batch']['ttft_error_median_ms'])}), load {row[name]['load_average_1m']:.1f}, "
                      f"send lag p99 {_ms(row[name]['interactive']['send_lag_p99_ms'])} ms, interactive scheduler "
                      f"queue p99 {_ms(row[name]['interactive']['scheduler_queue']['p99_ms'])} ms, cores "
                      + " ".join(f"{k} {v:.2f}" for k, v in row[name]["cpu"]["cores"].items() if v >= 0.05),
                      flush=True)
            out["multiples"][str(multiple)] = row
        return out


def scheduler_queue(before: dict[float, float], after: dict[float, float]) -> dict:
    """A class's wait in the scheduler's queue over a window (from its histogram, so coarse: buckets at 10, 25,
    50, 100, 250 ms): how much of its TTFT tail is the wait for a slot or a step."""
    quantiles = {f"{name}_ms": quantile_from_buckets(before, after, q) for name, q in (("p50", 0.5), ("p99", 0.99))}
    return {**{k: None if v is None else 1000 * v for k, v in quantiles.items()},
            "share_over_50ms": share_over(before, after, 0.05), "share_over_100ms": share_over(before, after, 0.1)}


def default_output(where: placement.Placement, load_procs: int, window_s: float = QUICK.generate_s,
                   admit_ttft_ms: dict[str, int] | None = None) -> Path:
    """Where a run writes unless told: a setting off the default is in the name, so runs beside each other
    do not overwrite each other."""
    suffix = "".join((f"_{where.value}" if where is not placement.Placement.SHARED else "",
                      f"_{load_procs}procs" if load_procs != MAX_LOAD_PROCS else "",
                      f"_{window_s:g}s" if window_s != QUICK.generate_s else "",
                      "".join(f"_admit-{name}{ms}" for name, ms in sorted((admit_ttft_ms or {}).items()))))
    return RESULTS_PATH.with_name(f"{RESULTS_PATH.stem}{suffix}{RESULTS_PATH.suffix}")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _predictor(error: dict) -> str:
    """A class's per-stream predictor error as printed: its median and how many streams it rests on."""
    return f"{_ms(error['median_abs_error_ms'])} (n={error['num_streams']})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"short windows: {QUICK.generate_s:g} s measured each (the default; --window-s for longer)")
    parser.add_argument("--window-s", type=float, default=QUICK.generate_s,
                        help="seconds measured per window, after its warm-up: a p99 of ~100 streams rests on one "
                             "or two of them, so 60+ s puts each 0.5x p99 on thousands (tinylm: ~2 600 interactive)")
    parser.add_argument("--generators", default="mock,tinylm", help="comma-separated of mock, tinylm")
    parser.add_argument("--placement", choices=[p.value for p in placement.Placement], default="shared",
                        help="shared: every process on every core; pinned: the worker on a core of its own "
                             "(bench/overload/placement.py)")
    parser.add_argument("--load-procs", type=int, default=MAX_LOAD_PROCS,
                        help="load generator processes (each has its own event loop and gRPC poller thread)")
    parser.add_argument("--output", type=Path, default=None,
                        help=f"default {RESULTS_PATH}, named for a setting off the default "
                             "(overload_slo_pinned.json, overload_slo_1procs.json, ...)")
    parser.add_argument("--streams-csv", type=Path, default=None,
                        help="also write every measured stream, with its TTFT and the gateway's prediction, here")
    parser.add_argument("--admit-ttft-ms", default="",
                        help="CLASS=MS[,...]: the TTFT target a class's streams send (admission judges it) instead "
                             "of the one the benchmark judges them at, e.g. interactive=60 (default: the same)")
    parser.add_argument("--multiples", default=",".join(map(str, MULTIPLES)),
                        help="comma-separated multiples of the peak to offer (1.0 is the reference)")
    args = parser.parse_args()
    exit_on_sigterm()  # stopped by SIGTERM, its mesh and load processes stop too
    if not args.window_s > 0:
        parser.error(f"--window-s must be > 0, got {args.window_s}")
    try:
        admit_ttft_ms = parse_admit_ttft(args.admit_ttft_ms)
    except ValueError as err:
        parser.error(str(err))
    profile = replace(QUICK, generate_s=args.window_s)
    where = placement.Placement(args.placement)
    output = args.output or default_output(where, args.load_procs, args.window_s, admit_ttft_ms)
    multiples = tuple(float(m) for m in args.multiples.split(","))
    chosen = [g.strip() for g in args.generators.split(",") if g.strip()]
    unknown = sorted(set(chosen) - set(GENERATORS))
    if unknown:
        parser.error(f"unknown generator(s) {', '.join(unknown)}; choose from {', '.join(GENERATORS)}")
    report: dict = {"benchmark": "overload_slo", "commit": _commit(), "placement": where.value,
                    "load_average_1m": os.getloadavg()[0],
                    "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
                    "classes": {c.name: c.__dict__ for c in (INTERACTIVE, BATCH)}, "generators": {},
                    # The TTFT each class sent where it differs from the one it is judged at (classes).
                    "admit_ttft_ms": admit_ttft_ms}
    if not 1 <= args.load_procs <= MAX_LOAD_PROCS:
        parser.error(f"--load-procs must be in [1, {MAX_LOAD_PROCS}], got {args.load_procs}")
    report["load_procs"] = args.load_procs
    report["window_s"] = {"warmup": profile.warmup_s, "measured": profile.generate_s}
    streams: list[tuple] | None = None if args.streams_csv is None else []
    with LoadPool(args.load_procs) as pool:
        for generator in chosen:
            report["generators"][generator] = run_generator(generator, pool, profile, multiples, where, streams,
                                                            admit_ttft_ms)
    if args.streams_csv is not None and streams is not None:
        with args.streams_csv.open("w", newline="") as out:
            writer = csv.writer(out)
            writer.writerow(STREAM_COLUMNS)
            writer.writerows(streams)
    sent = ", ".join(f"{name} sent TTFT {ms} ms" for name, ms in admit_ttft_ms.items()) or "classes sent their targets"
    for generator, result in report["generators"].items():
        rows = result["multiples"]
        print(f"{generator}: {sent}; judged at interactive {INTERACTIVE.ttft_ms} / {INTERACTIVE.tpot_ms} ms, "
              f"batch {BATCH.ttft_ms} ms")
        for name in ("slo", "deadline"):
            base = rows["1.0"][name]["goodput_per_s"] if "1.0" in rows else float("nan")
            ratios = ", ".join(f"{m}x {rows[m][name]['goodput_per_s'] / base:.2f}x" for m in rows if m != "1.0" and base)
            print(f"{generator} {name} ({where.value}): goodput at 1x {base:.2f}/s; {ratios} of it")
            if "0.5" in rows and "2.0" in rows:
                low, high = rows["0.5"][name]["interactive"]["ttft_p99_ms"], rows["2.0"][name]["interactive"]["ttft_p99_ms"]
                if low and high:
                    spread = ratio_interval(rows["2.0"][name]["interactive"].get("ttft_p99_ci_ms"),
                                            rows["0.5"][name]["interactive"].get("ttft_p99_ci_ms"))
                    within = "" if spread is None else f" (95% intervals of both p99s: {spread[0]:.2f}x-{spread[1]:.2f}x)"
                    print(f"{generator} {name} ({where.value}): interactive TTFT p99 at 2x {high:.0f} ms = "
                          f"{high / low:.2f}x of 0.5x{within}")
    write_report(output, finite(report))


if __name__ == "__main__":
    main()
