"""Overload: peak goodput, goodput past the peak, flood isolation, generate fairness, lone latency.

    .venv/bin/python -m bench.overload.bench_overload [--quick] [--runs N] [--only peak,multiples,flood,generate,lone]
                                            [--target HOST:PORT] [--peak-per-s R] [--output PATH]

Starts a `make up`-like mesh on 127.0.0.1 (scheduler, gateway with bench/overload/tenants.yaml,
one digits worker, one tinylm worker; each worker with one compute thread, as in
bench_scheduler) unless --target names a gateway already serving those models with that
tenants file. Load is open-loop Poisson from spawned load processes (bench/harness/load_pool.py)
replaying pre-built requests; latency runs from each request's scheduled send time, and each
request carries `x-request-start` with that time. Parts:

  peak       Classify on digits (raw 16x16x3 pixels), 100 ms deadlines: the offered rate grows
             1.5x while goodput (ok within 100 ms, per s) keeps >= 90% of it, then bisects; the
             peak is the best goodput seen.
  multiples  1x, 2x and 4x that peak offered: goodput as a fraction of the peak.
  flood      tenant A at a third of the peak alone, then while tenant B offers 10x its
             requests_per_s quota: A's p99 flooded / alone (1 s deadlines, so queueing shows).
  generate   tinylm streams (greedy, EOS ignored, prompts 8-48 bytes, max_tokens 8-128, 5 s
             deadlines). Capacity = streams/s completed by 48 closed-loop clients. A critical
             tenant's TTFT p99 at 3 streams/s alone vs while a sheddable tenant offers 2x capacity;
             a light tenant (3 streams/s) alone vs while a same-class, same-weight heavy tenant
             offers 2x capacity.
  lone       Classify at 20/s: p50 end to end.

Every part reports the load generator's own lag (actual - scheduled send) and flags a run whose
lag p99 exceeds 5 ms ("generator fell behind": it offered less than asked), the 1-minute load
average when the part started (the 2 cores are shared), and stage coverage: leaf stages of the
reply's timings / end-to-end latency, around p50 and at p99. The full run repeats every part 3
times and shows medians (every run in the JSON); --quick runs once with shorter windows.

Prints a table and writes bench/results/overload.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import numpy as np
import yaml

from bench.harness import cpu as harness_cpu
from bench.harness.load_plan import RequestTemplate, Rpc, Stream, build_plan, num_load_procs
from bench.harness.load_pool import ClosedLoopJob, LoadPool
from bench.harness.mesh_ready import TINYLM_MAX_NUM_SEQS, WORKER_ENV, wait_attached
from bench.harness.results import MODEL_REPO, RESULTS_DIR, ROOT, finite, write_report
from bench.harness.send_result import SendResult, in_window
from bench.harness.stats import ratio
from bench.overload.report import MULTIPLES, markdown_table, medians, noise_line, table_rows
from bench.overload.stats import by_tenant, summarize, summarize_streams
from infermesh.v1 import common_pb2, gateway_pb2
from loadtest.payloads import make_prompt, render_image
from tools.testbed.processes import ServiceProcess, running_mesh
from tools.testbed.valkey import ValkeyProcess

RESULTS_PATH = RESULTS_DIR / "overload.json"
TENANTS_PATH = ROOT / "bench" / "overload" / "tenants.yaml"
PARTS = ("peak", "multiples", "flood", "generate", "lone")
KEYS = {"bench": "overload-bench", "flood-a": "overload-flood-a", "flood-b": "overload-flood-b",
        "gen-critical": "overload-gen-critical", "gen-sheddable": "overload-gen-sheddable",
        "gen-light": "overload-gen-light", "gen-heavy": "overload-gen-heavy"}
GOODPUT_DEADLINE_S = 0.100
FLOOD_DEADLINE_S = 1.0
GENERATE_DEADLINE_S = 5.0
LAG_THRESHOLD_MS = 5.0
# One load process per this many requests/s: a request costs a load process 0.3-0.4 ms of CPU here, and
# on a shared box each process gets its own share of the cores.
PER_PROC_PER_S = 400.0
MAX_LOAD_PROCS = 3
LIGHT_STREAMS_PER_S = 3.0
CAPACITY_CLIENTS = 48
LONE_PER_S = 20.0

@dataclass(frozen=True)
class Profile:
    runs: int
    warmup_s: float  # sent before every measured window, not counted
    probe_s: float  # measured window of one peak-sweep probe
    num_bisections: int
    multiple_s: float
    flood_s: float
    capacity_s: float
    generate_s: float
    lone_s: float


FULL = Profile(runs=3, warmup_s=1.0, probe_s=4.0, num_bisections=2, multiple_s=20.0, flood_s=20.0, capacity_s=12.0,
               generate_s=20.0, lone_s=10.0)
QUICK = Profile(runs=1, warmup_s=1.0, probe_s=2.0, num_bisections=1, multiple_s=6.0, flood_s=6.0, capacity_s=6.0,
                generate_s=8.0, lone_s=5.0)


# -- requests -------------------------------------------------------------------------


def classify_templates(tenant: str, deadline_s: float, num_images: int = 10) -> tuple[RequestTemplate, ...]:
    """Digit images as raw 16x16x3 pixels, serialized once."""
    rng = np.random.default_rng(7)
    return tuple(RequestTemplate(
        Rpc.CLASSIFY,
        gateway_pb2.ClassifyRequest(
            model=common_pb2.ModelRef(name="digits"),
            image=common_pb2.Image(raw=common_pb2.RawImage(
                pixels=render_image(i % 10, 16, 16, 3, rng).tobytes(), height=16, width=16, channels=3)),
        ).SerializeToString(),
        KEYS[tenant], tenant, deadline_s) for i in range(num_images))


def generate_templates(tenant: str, seed: int, num: int = 400) -> tuple[RequestTemplate, ...]:
    """Greedy, EOS ignored, prompts of 8-48 bytes, max_tokens uniform in 8-128."""
    rng = np.random.default_rng([seed, 11])
    templates = []
    for i in range(num):
        request = gateway_pb2.GenerateRequest(
            model=common_pb2.ModelRef(name="tinylm"),
            prompt=make_prompt(int(rng.integers(8, 49)), rng),
            sampling=common_pb2.SamplingParams(max_tokens=int(rng.integers(8, 129)), temperature=0.0,
                                               ignore_eos=True, seed=i),
        )
        templates.append(RequestTemplate(Rpc.GENERATE, request.SerializeToString(), KEYS[tenant], tenant,
                                         GENERATE_DEADLINE_S))
    return tuple(templates)


def flood_quota_per_s() -> float:
    tenants = yaml.safe_load(TENANTS_PATH.read_text())["tenants"]
    return float(next(t for t in tenants if t["id"] == "flood-b")["quotas"]["requests_per_s"])


# -- running load ---------------------------------------------------------------------


@dataclass
class Bench:
    target: str
    pool: LoadPool
    profile: Profile
    pids: dict[str, int]  # processes whose CPU each part reports: the mesh's (when started here) and the load's
    seed: int = 0
    send_cpu_us_per_request: float = 0.0  # the load processes' CPU while sending, in the last replay

    def replay(self, streams: list[Stream]) -> list[SendResult]:
        """Runs the streams together; results measured after the warm-up only."""
        self.seed += 1
        plan = build_plan(streams, self.seed)
        if any(t.rpc is Rpc.GENERATE for t in plan.templates):
            num_procs = self.pool.max_procs  # every token is a chunk to receive: spread them
        else:
            num_procs = num_load_procs(sum(s.rate_per_s for s in streams), PER_PROC_PER_S, self.pool.max_procs)
        results = self.pool.replay(self.target, plan, num_procs)
        self.send_cpu_us_per_request = 1e6 * self.pool.last_send_cpu_s / max(1, len(plan.sends))
        time.sleep(0.5)  # queues drain (deadlines are short) before the next window
        return in_window(results, self.profile.warmup_s, plan.duration_s)

    def open_loop(self, templates: tuple[RequestTemplate, ...], rate_per_s: float, measured_s: float) -> list[SendResult]:
        return self.replay([Stream(templates, rate_per_s, self.profile.warmup_s + measured_s)])


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU time each process has used so far (fields 14 and 15 of /proc/<pid>/stat)."""
    used = {}
    for name, pid in pids.items():
        try:
            used[name] = harness_cpu.cpu_seconds(pid)
        except FileNotFoundError:
            continue
    return used


# -- parts ----------------------------------------------------------------------------


def part_peak(bench: Bench, start_per_s: float = 100.0) -> dict:
    """Grows the offered rate 1.5x while goodput keeps up (>= 90% of offered), then bisects."""
    templates = classify_templates("bench", GOODPUT_DEADLINE_S)
    probes = []

    def probe(rate_per_s: float) -> dict:
        results = bench.open_loop(templates, rate_per_s, bench.profile.probe_s)
        summary = summarize(results, bench.profile.probe_s, GOODPUT_DEADLINE_S, LAG_THRESHOLD_MS)
        summary["target_per_s"] = rate_per_s
        summary["generator_cpu_us_per_request"] = bench.send_cpu_us_per_request
        summary["kept_up"] = summary["goodput_per_s"] >= 0.9 * rate_per_s
        probes.append(summary)
        _progress(f"  probe {rate_per_s:.0f}/s: goodput {summary['goodput_per_s']:.0f}/s, p99 "
                  f"{summary['p99_ms']:.1f} ms, lag p99 {summary['lag_p99_ms']:.1f} ms")
        return summary

    rate = start_per_s
    last_pass = None
    while probe(rate)["kept_up"] and rate < 20_000:
        last_pass = rate
        rate *= 1.5
    low, high = (last_pass, rate) if last_pass is not None else (rate / 4, rate)
    for _ in range(bench.profile.num_bisections):
        mid = (low + high) / 2
        if probe(mid)["kept_up"]:
            low = mid
        else:
            high = mid
    best = max(probes, key=lambda p: p["goodput_per_s"])
    return {"peak_per_s": best["goodput_per_s"], "at_offered_per_s": best["target_per_s"], "best": best,
            "probes": probes}


def part_multiples(bench: Bench, peak_per_s: float) -> dict:
    templates = classify_templates("bench", GOODPUT_DEADLINE_S)
    out = {"peak_per_s": peak_per_s}
    for multiple in MULTIPLES:
        results = bench.open_loop(templates, multiple * peak_per_s, bench.profile.multiple_s)
        summary = summarize(results, bench.profile.multiple_s, GOODPUT_DEADLINE_S, LAG_THRESHOLD_MS)
        summary["fraction_of_peak"] = summary["goodput_per_s"] / peak_per_s
        summary["generator_cpu_us_per_request"] = bench.send_cpu_us_per_request
        out[f"{multiple:g}x"] = summary
        _progress(f"  {multiple:g}x ({multiple * peak_per_s:.0f}/s): goodput {summary['goodput_per_s']:.0f}/s = "
                  f"{summary['fraction_of_peak']:.2f} of peak, lag p99 {summary['lag_p99_ms']:.1f} ms, generator "
                  f"{summary['generator_cpu_us_per_request']:.0f} us CPU/request")
    return out


def part_flood(bench: Bench, peak_per_s: float) -> dict:
    a_per_s = peak_per_s / 3
    b_per_s = 10 * flood_quota_per_s()
    window_s = bench.profile.warmup_s + bench.profile.flood_s
    a = classify_templates("flood-a", FLOOD_DEADLINE_S)
    alone = bench.open_loop(a, a_per_s, bench.profile.flood_s)
    flooded = by_tenant(bench.replay([Stream(a, a_per_s, window_s),
                                      Stream(classify_templates("flood-b", FLOOD_DEADLINE_S), b_per_s, window_s)]))
    s = bench.profile.flood_s
    out = {"a_per_s": a_per_s, "b_per_s": b_per_s,
           "alone": summarize(alone, s, FLOOD_DEADLINE_S, LAG_THRESHOLD_MS),
           "flooded": summarize(flooded.get("flood-a", []), s, FLOOD_DEADLINE_S, LAG_THRESHOLD_MS),
           "flood_b": summarize(flooded.get("flood-b", []), s, FLOOD_DEADLINE_S, LAG_THRESHOLD_MS)}
    out["p99_ratio"] = ratio(out["flooded"]["p99_ms"], out["alone"]["p99_ms"])
    _progress(f"  A p99 alone {out['alone']['p99_ms']:.1f} ms, flooded {out['flooded']['p99_ms']:.1f} ms "
              f"({out['p99_ratio']:.2f}x); B ok {out['flood_b']['throughput_per_s']:.0f}/s of {b_per_s:.0f}/s")
    return out


def part_generate(bench: Bench) -> dict:
    capacity = generate_capacity(bench)
    flood_per_s = 2 * capacity["streams_per_s"]
    window_s = bench.profile.warmup_s + bench.profile.generate_s
    out = {"capacity": capacity, "flood_per_s": flood_per_s, "light_per_s": LIGHT_STREAMS_PER_S}
    for name, light, heavy in (("critical", "gen-critical", "gen-sheddable"), ("fairness", "gen-light", "gen-heavy")):
        light_templates = generate_templates(light, seed=1)
        alone = bench.open_loop(light_templates, LIGHT_STREAMS_PER_S, bench.profile.generate_s)
        flooded = by_tenant(bench.replay([Stream(light_templates, LIGHT_STREAMS_PER_S, window_s),
                                          Stream(generate_templates(heavy, seed=2), flood_per_s, window_s)]))
        s = bench.profile.generate_s
        part = {"alone": summarize_streams(alone, s, LAG_THRESHOLD_MS),
                "flooded": summarize_streams(flooded.get(light, []), s, LAG_THRESHOLD_MS),
                "flooder": summarize_streams(flooded.get(heavy, []), s, LAG_THRESHOLD_MS)}
        part["ttft_p99_ratio"] = ratio(part["flooded"]["ttft_p99_ms"], part["alone"]["ttft_p99_ms"])
        part["e2e_p99_ratio"] = ratio(part["flooded"]["e2e_p99_ms"], part["alone"]["e2e_p99_ms"])
        out[name] = part
        _progress(f"  {name}: {light} TTFT p99 alone {part['alone']['ttft_p99_ms']:.0f} ms, with {heavy} at "
                  f"{flood_per_s:.1f}/s {part['flooded']['ttft_p99_ms']:.0f} ms ({part['ttft_p99_ratio']:.2f}x); "
                  f"e2e p99 {part['alone']['e2e_p99_ms']:.0f} -> {part['flooded']['e2e_p99_ms']:.0f} ms")
    return out


def generate_capacity(bench: Bench) -> dict:
    """Streams/s completed with the running set kept full (closed loop), after a 1 s ramp."""
    job = ClosedLoopJob(generate_templates("gen-heavy", seed=3), CAPACITY_CLIENTS, 1.0 + bench.profile.capacity_s)
    results, _ = bench.pool.closed_loop(bench.target, job)
    done = [r for r in results if r.ok and r.done_s >= 1.0]
    streams_per_s = len(done) / bench.profile.capacity_s
    time.sleep(0.5)
    _progress(f"  capacity: {streams_per_s:.1f} streams/s ({CAPACITY_CLIENTS} closed-loop clients)")
    return {"streams_per_s": streams_per_s, "clients": CAPACITY_CLIENTS, "num_errors": sum(not r.ok for r in results),
            "output_tokens_per_s": sum(r.num_tokens for r in done) / bench.profile.capacity_s}


def part_lone(bench: Bench) -> dict:
    results = bench.open_loop(classify_templates("bench", FLOOD_DEADLINE_S), LONE_PER_S, bench.profile.lone_s)
    summary = summarize(results, bench.profile.lone_s, FLOOD_DEADLINE_S, LAG_THRESHOLD_MS)
    _progress(f"  lone: p50 {summary['p50_ms']:.2f} ms, p99 {summary['p99_ms']:.2f} ms")
    return summary


def run_once(bench: Bench, parts: list[str], peak_per_s: float | None) -> dict:
    out = {}

    def timed(name: str, body: Callable[[], dict]) -> None:
        load_1m = load_average()
        _progress(f"{name} (load average {load_1m})")
        cpu_before, began = cpu_seconds(bench.pids), time.monotonic()
        result = body()
        elapsed_s = time.monotonic() - began
        cpu_cores = {name: round((used - cpu_before[name]) / elapsed_s, 2)
                     for name, used in cpu_seconds(bench.pids).items()}
        out[name] = {**result, "load_average_1m": load_1m, "elapsed_s": round(elapsed_s, 1), "cpu_cores": cpu_cores}
        _progress(f"  cores used over {elapsed_s:.0f} s: " + ", ".join(f"{k} {v:.2f}" for k, v in cpu_cores.items()))

    if "peak" in parts or (peak_per_s is None and {"multiples", "flood"} & set(parts)):
        timed("peak", lambda: part_peak(bench))
        peak_per_s = out["peak"]["peak_per_s"]
    if "multiples" in parts:
        timed("multiples", lambda: part_multiples(bench, peak_per_s))
    if "flood" in parts:
        timed("flood", lambda: part_flood(bench, peak_per_s))
    if "generate" in parts:
        timed("generate", lambda: part_generate(bench))
    if "lone" in parts:
        timed("lone", lambda: part_lone(bench))
    return out


# -- the mesh -------------------------------------------------------------------------


@contextmanager
def mesh(need_generator: bool, gateway_processes: int = 1) -> Iterator[tuple[str, dict[str, int]]]:
    """Scheduler, gateway and workers as processes; yields the gateway's address and the processes'
    pids once every model serves. With gateway_processes > 1, that many gateways listen on the one
    port (SO_REUSEPORT, grpc's default: the kernel spreads connections over them), their quotas
    shared through a Valkey store, as `make up` would run them on a machine with more cores."""
    with tempfile.TemporaryDirectory(prefix="bench-overload-") as tmp, running_mesh(Path(tmp), tls=False) as m, \
            _quota_store(Path(tmp), gateway_processes) as store_args:
        m.start_scheduler("--log-level", "WARNING")
        m.start_worker("digits", "--log-level", "WARNING", "--model-repository", str(MODEL_REPO), env=WORKER_ENV)
        models = ["digits"]
        if need_generator:
            m.start_worker("tinylm", "--log-level", "WARNING", "--model-repository", str(MODEL_REPO),
                           "--max-num-seqs", str(TINYLM_MAX_NUM_SEQS), env=WORKER_ENV)
            models.append("tinylm")
        wait_attached(m.scheduler.address, len(models))
        gateway_args = ("--tenants-file", str(TENANTS_PATH), "--log-level", "WARNING", *store_args)
        m.start_gateway(*gateway_args)
        for i in range(1, gateway_processes):
            same_port = ServiceProcess(f"gateway{i + 1}", "gateway", m.gateway.port,
                                       ["--scheduler-address", m.scheduler.address, *gateway_args],
                                       dict(m.env), Path(tmp) / f"gateway{i + 1}.log", tls=False)
            m.processes.append(same_port.start())
            same_port.wait_serving()
        _wait_gateway_serves(m.gateway.address)
        yield m.gateway.address, {p.name: p.proc.pid for p in m.processes}


@contextmanager
def _quota_store(tmp: Path, gateway_processes: int) -> Iterator[tuple[str, ...]]:
    """The gateways' flags for one shared quota store (none for a single gateway)."""
    if gateway_processes <= 1:
        yield ()
        return
    store = ValkeyProcess(tmp).start()
    try:
        yield ("--quota-store-address", store.address, "--quota-expected-gateways", str(gateway_processes))
    finally:
        store.stop()




def _wait_gateway_serves(address: str, timeout_s: float = 30.0) -> None:
    """Until a Classify through the gateway succeeds (routes and pressure known)."""
    request = classify_templates("bench", 5.0)[0]
    give_up = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        classify = channel.unary_unary("/infermesh.v1.Inference/Classify")
        while True:
            try:
                classify(request.body, timeout=5, metadata=(("authorization", f"Bearer {request.api_key}"),))
                return
            except grpc.RpcError as err:
                if time.monotonic() > give_up:
                    raise TimeoutError(f"gateway {address} did not serve digits: {err.code().name}") from err
                time.sleep(0.2)


def _progress(message: str) -> None:
    print(message, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run, shorter windows (a few minutes)")
    parser.add_argument("--runs", type=int, default=None, help="runs of every part (median shown)")
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {','.join(PARTS)}")
    parser.add_argument("--target", default=None, help="an existing gateway (tenants: bench/overload/tenants.yaml)")
    parser.add_argument("--peak-per-s", type=float, default=None, help="skip the sweep for multiples/flood")
    parser.add_argument("--gateway-processes", type=int, default=1,
                        help="gateways on the one port (SO_REUSEPORT), quotas shared through a Valkey store")
    parser.add_argument("--label", default="", help="stored in the JSON (e.g. baseline)")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    args = parser.parse_args()
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    profile = QUICK if args.quick else FULL
    if args.runs:
        profile = Profile(**{**asdict(profile), "runs": args.runs})
    began = time.monotonic()
    runs = []
    with LoadPool(MAX_LOAD_PROCS) as pool:
        started = _existing(args.target) if args.target else mesh("generate" in parts, args.gateway_processes)
        with started as (target, pids):
            bench = Bench(target, pool, profile, {**pids, **pool.pids})
            for run in range(profile.runs):
                _progress(f"== run {run + 1}/{profile.runs}")
                runs.append(run_once(bench, parts, args.peak_per_s))
    rows = table_rows(runs)
    print()
    print(markdown_table(rows))
    print(noise_line(runs))
    print(f"{profile.runs} run(s); {time.monotonic() - began:.0f} s in all")
    report = {
        "benchmark": "overload",
        "label": args.label,
        "commit": _commit(),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "profile": asdict(profile),
        "quick": args.quick,
        "gateway_processes": args.gateway_processes,
        "settings": {"goodput_deadline_s": GOODPUT_DEADLINE_S, "flood_deadline_s": FLOOD_DEADLINE_S,
                     "generate_deadline_s": GENERATE_DEADLINE_S, "lag_threshold_ms": LAG_THRESHOLD_MS,
                     "flood_quota_per_s": flood_quota_per_s(), "max_load_procs": MAX_LOAD_PROCS,
                     "per_proc_per_s": PER_PROC_PER_S},
        "medians": medians(runs),
        "table": [dict(zip(("figure", "every_run", "median", "target", "coverage", "lag_p99_ms"), r, strict=True))
                  for r in rows],
        "runs": runs,
    }
    write_report(args.output, finite(report))


@contextmanager
def _existing(target: str) -> Iterator[tuple[str, dict[str, int]]]:
    yield target, {}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


if __name__ == "__main__":
    main()
