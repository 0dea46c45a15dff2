"""The OpenAI-compatible HTTP front against the gRPC Generate: the same open-loop load through each.

    .venv/bin/python -m bench.gateway.bench_openai [--quick] [--rate-per-s R] [--window-s S] [--rounds N] [--output PATH]

Starts a mesh on 127.0.0.1, plaintext (the comparison is of the two fronts, not of TLS): a
scheduler, one mock generator worker (10 ms per step, no torch) and a gateway with --http-port.
Load is open-loop Poisson at R streams/s from this process (uvloop): each stream a 16-byte
prompt, 32 tokens, EOS ignored, greedy. The same arrival schedule is sent through gRPC
(`Inference.Generate`, grpc.aio) and through HTTP (`POST /v1/completions`, stream=true,
aiohttp client with keep-alive), alternating for N rounds so drift on the shared box hits
both. Latency runs from each stream's scheduled send time:

    TTFT          scheduled send -> first chunk (gRPC message / SSE event)
    inter-token   gaps between consecutive chunks of a stream (one token per chunk here)
    gateway CPU   the gateway process's user+system CPU over the window / streams completed;
                  the HTTP front's own cost is the HTTP path's minus the gRPC path's

Target (issue 15): TTFT p99 through HTTP <= 1.2x through gRPC at the same rate.
Prints a markdown table and writes bench/results/openai.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import grpc
import numpy as np
import psutil
import uvloop

from bench.harness.mesh_ready import wait_attached
from bench.harness.results import RESULTS_DIR, write_report
from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tools.testbed.processes import free_port, running_mesh

RESULTS_PATH = RESULTS_DIR / "openai.json"
MODEL = "mock-generator"
MOCK_PROFILE = "step_ms=10,max_num_seqs=256,num_kv_blocks=4096,block_size=16,max_seq_len=512"
PROMPT_BYTES = 16
MAX_TOKENS = 32
TIMEOUT_S = 30.0
TTFT_TARGET_RATIO = 1.2


@dataclass
class StreamRecord:
    ttft_ms: float | None = None
    gaps_ms: list[float] = field(default_factory=list)
    error: str | None = None
    send_lag_ms: float = 0.0  # actual send minus scheduled send: the load generator's own lag


@dataclass(frozen=True)
class PathFigures:
    path: str
    num_streams: int
    num_errors: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    inter_token_p50_ms: float
    inter_token_p99_ms: float
    gateway_cpu_ms_per_stream: float
    send_lag_p99_ms: float
    send_lag_max_ms: float
    ttft_p99_ms_per_round: tuple[float, ...]


def _prompt(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(PROMPT_BYTES))


def _schedule(rate_per_s: float, window_s: float, seed: int) -> list[tuple[float, str]]:
    """(offset_s, prompt) of every stream: Poisson arrivals, the same for both paths."""
    rng = random.Random(seed)
    at_s, plan = 0.0, []
    while True:
        at_s += rng.expovariate(rate_per_s)
        if at_s >= window_s:
            return plan
        plan.append((at_s, _prompt(rng)))


class _Chunks:
    """Times one stream's chunks against its scheduled send time."""

    def __init__(self, record: StreamRecord, scheduled_s: float) -> None:
        self._record = record
        self._last_s = scheduled_s
        self._scheduled_s = scheduled_s

    def chunk(self) -> None:
        now_s = time.perf_counter()
        if self._record.ttft_ms is None:
            self._record.ttft_ms = (now_s - self._scheduled_s) * 1000
        else:
            self._record.gaps_ms.append((now_s - self._last_s) * 1000)
        self._last_s = now_s


async def _grpc_stream(stub, prompt: str, record: StreamRecord, scheduled_s: float) -> None:
    request = gateway_pb2.GenerateRequest(
        model=common_pb2.ModelRef(name=MODEL), prompt=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    timer = _Chunks(record, scheduled_s)
    try:
        async for _chunk in stub.Generate(request, timeout=TIMEOUT_S):
            timer.chunk()
    except grpc.aio.AioRpcError as exc:
        record.error = exc.code().name


async def _http_stream(session: aiohttp.ClientSession, url: str, prompt: str, record: StreamRecord,
                       scheduled_s: float) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}
    timer = _Chunks(record, scheduled_s)
    try:
        async with session.post(url, json=body, headers={"x-infermesh-timeout-ms": str(TIMEOUT_S * 1000)}) as reply:
            if reply.status != 200:
                record.error = f"HTTP {reply.status}"
                return
            async for line in reply.content:
                if line.startswith(b"data: ") and line != b"data: [DONE]\n":
                    if b'"error"' in line[:16]:
                        record.error = "error event"
                        return
                    timer.chunk()
    except aiohttp.ClientError as exc:
        record.error = type(exc).__name__


async def _drive(plan: list[tuple[float, str]], send) -> list[StreamRecord]:
    """Sends every stream at its scheduled time (open loop) and waits for all of them."""
    records = [StreamRecord() for _ in plan]
    tasks = []
    start_s = time.perf_counter() + 0.05
    for (offset_s, prompt), record in zip(plan, records, strict=True):
        scheduled_s = start_s + offset_s
        delay_s = scheduled_s - time.perf_counter()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        record.send_lag_ms = max(0.0, (time.perf_counter() - scheduled_s) * 1000)
        tasks.append(asyncio.create_task(send(prompt, record, scheduled_s)))
    await asyncio.gather(*tasks)
    return records


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _ttft_p99(records: list[StreamRecord]) -> float:
    ttft = [r.ttft_ms for r in records if r.error is None and r.ttft_ms is not None]
    return round(float(np.percentile(ttft, 99)), 2) if ttft else float("nan")


def _figures(path: str, rounds: list[list[StreamRecord]], cpu_s: float) -> PathFigures:
    records = [r for round_records in rounds for r in round_records]
    lags = np.array([r.send_lag_ms for r in records]) if records else np.array([np.nan])
    ok = [r for r in records if r.error is None and r.ttft_ms is not None]
    ttft = np.array([r.ttft_ms for r in ok]) if ok else np.array([np.nan])
    gaps = np.array([g for r in ok for g in r.gaps_ms]) if ok else np.array([np.nan])
    return PathFigures(
        path=path, num_streams=len(ok), num_errors=len(records) - len(ok),
        ttft_p50_ms=round(float(np.percentile(ttft, 50)), 2), ttft_p99_ms=round(float(np.percentile(ttft, 99)), 2),
        inter_token_p50_ms=round(float(np.percentile(gaps, 50)), 2),
        inter_token_p99_ms=round(float(np.percentile(gaps, 99)), 2),
        gateway_cpu_ms_per_stream=round(cpu_s * 1000 / max(1, len(ok)), 3),
        send_lag_p99_ms=round(float(np.percentile(lags, 99)), 2), send_lag_max_ms=round(float(lags.max()), 2),
        ttft_p99_ms_per_round=tuple(_ttft_p99(r) for r in rounds),
    )


async def _run(grpc_address: str, http_url: str, gateway: psutil.Process, rate_per_s: float, window_s: float,
               rounds: int) -> dict:
    records: dict[str, list[list[StreamRecord]]] = {"grpc": [], "http": []}
    cpu_s = {"grpc": 0.0, "http": 0.0}
    connector = aiohttp.TCPConnector(limit=0)
    async with grpc.aio.insecure_channel(grpc_address) as channel, \
            aiohttp.ClientSession(connector=connector) as session:
        stub = gateway_pb2_grpc.InferenceStub(channel)
        senders = {
            "grpc": lambda prompt, record, at_s: _grpc_stream(stub, prompt, record, at_s),
            "http": lambda prompt, record, at_s: _http_stream(session, http_url, prompt, record, at_s),
        }
        warmup = _schedule(rate_per_s, 1.0, seed=0)
        for send in senders.values():  # connections open, code paths warm
            await _drive(warmup, send)
        for round_number in range(rounds):
            plan = _schedule(rate_per_s, window_s, seed=round_number + 1)
            order = ("grpc", "http") if round_number % 2 == 0 else ("http", "grpc")
            for path in order:
                before_s = _cpu_s(gateway)
                records[path].append(await _drive(plan, senders[path]))
                cpu_s[path] += _cpu_s(gateway) - before_s
    return {path: _figures(path, records[path], cpu_s[path]) for path in records}


def _table(figures: dict[str, PathFigures], rate_per_s: float) -> str:
    grpc_f, http_f = figures["grpc"], figures["http"]
    rows = ["| path | streams (errors) | TTFT p50 ms | TTFT p99 ms | TTFT p99 per round | inter-token p50 ms | "
            "inter-token p99 ms | gateway CPU ms/stream | send lag p99 / max ms |", "|---|---|---|---|---|---|---|---|---|"]
    for f in (grpc_f, http_f):
        per_round = ", ".join(f"{v:g}" for v in f.ttft_p99_ms_per_round)
        rows.append(f"| {f.path} | {f.num_streams} ({f.num_errors}) | {f.ttft_p50_ms} | {f.ttft_p99_ms} | {per_round} | "
                    f"{f.inter_token_p50_ms} | {f.inter_token_p99_ms} | {f.gateway_cpu_ms_per_stream} | "
                    f"{f.send_lag_p99_ms} / {f.send_lag_max_ms} |")
    ratio = http_f.ttft_p99_ms / grpc_f.ttft_p99_ms if grpc_f.ttft_p99_ms else float("nan")
    extra = http_f.gateway_cpu_ms_per_stream - grpc_f.gateway_cpu_ms_per_stream
    rows.append("")
    rows.append(f"{rate_per_s:g} streams/s x {MAX_TOKENS} tokens. TTFT p99 HTTP / gRPC = {ratio:.2f} "
                f"(target <= {TTFT_TARGET_RATIO}); the HTTP front's own CPU = {extra:.3f} ms per stream "
                f"({extra * 1000 / MAX_TOKENS:.1f} us per token)")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 10 s per path (default: 4 of 20 s)")
    parser.add_argument("--rate-per-s", type=float, default=20.0, help="streams offered per second")
    parser.add_argument("--window-s", type=float, help="seconds of load per path per round")
    parser.add_argument("--rounds", type=int, help="rounds, each sending the load through both paths")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    args = parser.parse_args()
    window_s = args.window_s or (10.0 if args.quick else 20.0)
    rounds = args.rounds or (2 if args.quick else 4)
    load_average = os.getloadavg()[0]
    http_port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-openai-") as tmp, running_mesh(Path(tmp), tls=False) as mesh:
        mesh.start_scheduler("--log-level", "WARNING")
        mesh.start_worker("mock-generator", "--mock-profile", MOCK_PROFILE, "--log-level", "WARNING")
        wait_attached(mesh.scheduler.address, 1)
        mesh.start_gateway("--http-port", str(http_port), "--log-level", "WARNING", "--limit-initial", "1024")
        figures = uvloop.run(_run(mesh.gateway.address, f"http://127.0.0.1:{http_port}/v1/completions",
                                  psutil.Process(mesh.gateway.proc.pid), args.rate_per_s, window_s, rounds))
    table = _table(figures, args.rate_per_s)
    print(table)
    result = {
        "bench": "openai", "quick": args.quick, "rate_per_s": args.rate_per_s, "window_s": window_s,
        "rounds": rounds, "max_tokens": MAX_TOKENS, "prompt_bytes": PROMPT_BYTES, "mock_profile": MOCK_PROFILE,
        "paths": {path: asdict(f) for path, f in figures.items()},
        "ttft_p99_ratio": round(figures["http"].ttft_p99_ms / figures["grpc"].ttft_p99_ms, 3)
        if figures["grpc"].ttft_p99_ms else None,
        "load_average_1m_at_start": load_average, "cpus": os.cpu_count(), "machine": platform.machine(),
        "table": table,
    }
    write_report(args.output, result)


if __name__ == "__main__":
    main()
