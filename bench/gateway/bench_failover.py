"""What a client sees when one of two schedulers is SIGKILLed under load: classify latency around
the kill, and how long a stream stalls while the gateway resumes it on the other scheduler.

    .venv/bin/python -m bench.gateway.bench_failover [--rounds 2] [--classify-per-s 40] [--streams-per-s 4]
                                             [--before-s 4] [--after-s 4] [--modes stream,unary]

Per round, per upstream mode, per victim ("toy-classifier" or "mock-generator": the scheduler that
the gateway prefers for that model, by the same rendezvous hash, is the one killed): a fresh mesh
of two schedulers, a toy classifier (5 ms) and a mock generator (20 ms step, 80-token streams,
greedy) worker on each, and one gateway given both addresses. An open-loop grpc.aio client in this
process sends classify and streams at fixed rates for --before-s, the victim is SIGKILLed, and the
load goes on for --after-s. Reported:

  classify    calls, failures, p50/p99 latency before the kill and in the 2 s after it
  streams     streams, failures, wrong text (vs the unbroken reference), resumed (gateway metric),
              the longest gap between two chunks of a stream in flight at the kill (the resume
              stall) against the median chunk gap before the kill

The client shares the machine's cores with the five processes, so latencies are upper bounds.
Prints a table and writes ``bench/results/failover.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from bench.harness.results import RESULTS_DIR, write_report
from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.routing.replicas import rendezvous_order
from tools.testbed import session_tls
from tools.testbed.gateway_fixtures import scrape
from tools.testbed.generator_models import mock_text
from tools.testbed.mesh_replicas import replicated_mesh
from tools.testbed.processes import free_port

RESULTS_PATH = RESULTS_DIR / "failover.json"
MODELS = ("toy-classifier", "mock-generator")
CLASSIFIER = common_pb2.ModelRef(name="toy-classifier")
GENERATOR = common_pb2.ModelRef(name="mock-generator")
BRIGHT = common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes([250] * 12), height=2, width=2, channels=3))
PROMPTS = ("abc", "hello", "mesh")
NUM_TOKENS = 80
AFTER_WINDOW_S = 2.0


@dataclass
class Calls:
    # (sent_s, latency_s, ok) per classify
    classify: list[tuple[float, float, bool]] = field(default_factory=list)
    # per stream: (sent_s, ok, text_ok, chunk arrival times)
    streams: list[tuple[float, bool, bool, list[float]]] = field(default_factory=list)


@dataclass(frozen=True)
class Run:
    round: int
    mode: str
    victim_of: str
    num_classify: int
    classify_failed: int
    classify_p50_before_ms: float
    classify_p99_before_ms: float
    classify_p50_after_ms: float
    classify_p99_after_ms: float
    num_streams: int
    streams_failed: int
    streams_wrong_text: int
    streams_resumed: int
    failovers: int
    chunk_gap_p50_before_ms: float
    resume_stall_max_ms: float
    resume_stall_p50_ms: float


async def _classify(stub, calls: Calls) -> None:
    sent_s = time.monotonic()
    try:
        reply = await stub.Classify(gateway_pb2.ClassifyRequest(model=CLASSIFIER, image=BRIGHT), timeout=10)
        ok = reply.labels[0].label == "bright"
    except grpc.RpcError:
        ok = False
    calls.classify.append((sent_s, time.monotonic() - sent_s, ok))


async def _stream(stub, number: int, calls: Calls) -> None:
    prompt = PROMPTS[number % len(PROMPTS)]
    sent_s = time.monotonic()
    request = gateway_pb2.GenerateRequest(model=GENERATOR, prompt=prompt,
                                          sampling=common_pb2.SamplingParams(max_tokens=NUM_TOKENS))
    arrivals, text, ok = [], [], True
    try:
        async for chunk in stub.Generate(request, timeout=30):
            arrivals.append(time.monotonic())
            text.append(chunk.text)
    except grpc.RpcError:
        ok = False
    calls.streams.append((sent_s, ok, "".join(text) == mock_text(prompt, NUM_TOKENS), arrivals))


async def _open_loop(rate_per_s: float, until_s: float, start) -> None:
    tasks, number, next_s = [], 0, time.monotonic()
    while next_s < until_s:
        tasks.append(asyncio.ensure_future(start(number)))
        number += 1
        next_s += 1 / rate_per_s
        await asyncio.sleep(max(0.0, next_s - time.monotonic()))
    await asyncio.gather(*tasks)


async def _drive(address: str, args, kill) -> tuple[Calls, float]:
    calls = Calls()
    async with session_tls.aio_channel(address) as channel:  # the replicated mesh runs mTLS, as in the tests
        stub = gateway_pb2_grpc.InferenceStub(channel)
        until_s = time.monotonic() + args.before_s + args.after_s
        loops = asyncio.gather(
            _open_loop(args.classify_per_s, until_s, lambda n: _classify(stub, calls)),
            _open_loop(args.streams_per_s, until_s, lambda n: _stream(stub, n, calls)),
        )
        await asyncio.sleep(args.before_s)
        killed_s = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(None, kill)
        await loops
    return calls, killed_s


def _ms(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summarize(round_number: int, mode: str, victim_of: str, calls: Calls, killed_s: float, metrics) -> Run:
    before = [lat for sent, lat, ok in calls.classify if sent < killed_s and ok]
    after = [lat for sent, lat, ok in calls.classify if killed_s <= sent < killed_s + AFTER_WINDOW_S and ok]
    gaps_before, stalls = [], []
    for _, _, _, arrivals in calls.streams:
        gaps = [(b, b - a) for a, b in zip(arrivals, arrivals[1:], strict=False)]
        gaps_before += [g for at, g in gaps if at < killed_s]
        if arrivals and arrivals[0] < killed_s < arrivals[-1]:  # in flight at the kill
            stalls.append(max(g for at, g in gaps if at >= killed_s))
    return Run(
        round=round_number, mode=mode, victim_of=victim_of,
        num_classify=len(calls.classify), classify_failed=sum(not ok for _, _, ok in calls.classify),
        classify_p50_before_ms=_ms(before, 0.5), classify_p99_before_ms=_ms(before, 0.99),
        classify_p50_after_ms=_ms(after, 0.5), classify_p99_after_ms=_ms(after, 0.99),
        num_streams=len(calls.streams), streams_failed=sum(not ok for _, ok, _, _ in calls.streams),
        streams_wrong_text=sum(ok and not text_ok for _, ok, text_ok, _ in calls.streams),
        streams_resumed=int(metrics.value("infermesh_gateway_stream_resumes_total")),
        failovers=int(metrics.value("infermesh_gateway_failovers_total")),
        chunk_gap_p50_before_ms=_ms(gaps_before, 0.5),
        resume_stall_max_ms=_ms(stalls, 1.0), resume_stall_p50_ms=_ms(stalls, 0.5),
    )


def run_once(round_number: int, mode: str, victim_of: str, args) -> Run:
    with tempfile.TemporaryDirectory() as tmp, replicated_mesh(Path(tmp)) as mesh:
        mesh.add_schedulers(2)
        for model in MODELS:
            for _ in range(2):
                mesh.add_worker(model)
        mesh.wait_spread(list(MODELS))
        metrics_port = free_port()
        gateway = mesh.add_gateway("--upstream-mode", mode, "--pressure-poll-interval-ms", "200",
                                   "--metrics-port", str(metrics_port))
        preferred = rendezvous_order(victim_of, [s.address for s in mesh.schedulers])[0]
        victim = next(s for s in mesh.schedulers if s.address == preferred)

        def kill() -> None:
            victim.signal(signal.SIGKILL)
            victim.proc.wait(timeout=5)

        calls, killed_s = asyncio.run(_drive(gateway.address, args, kill))
        return _summarize(round_number, mode, victim_of, calls, killed_s, scrape(metrics_port))


def _table(runs: list[Run]) -> str:
    lines = ["round mode   victim          classify fail p50/p99 before ms  p50/p99 after ms | streams fail wrong "
             "resumed failovers gap p50 ms stall p50/max ms"]
    for r in runs:
        lines.append(
            f"{r.round:5} {r.mode:6} {r.victim_of:15} {r.num_classify:8} {r.classify_failed:4} "
            f"{r.classify_p50_before_ms:7.1f}/{r.classify_p99_before_ms:<7.1f}        "
            f"{r.classify_p50_after_ms:7.1f}/{r.classify_p99_after_ms:<7.1f} | {r.num_streams:7} "
            f"{r.streams_failed:4} {r.streams_wrong_text:5} {r.streams_resumed:7} {r.failovers:9} "
            f"{r.chunk_gap_p50_before_ms:10.1f} {r.resume_stall_p50_ms:7.1f}/{r.resume_stall_max_ms:.1f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--classify-per-s", type=float, default=40.0)
    parser.add_argument("--streams-per-s", type=float, default=4.0)
    parser.add_argument("--before-s", type=float, default=4.0)
    parser.add_argument("--after-s", type=float, default=4.0)
    parser.add_argument("--modes", default="stream,unary")
    parser.add_argument("--quick", action="store_true", help="one round (make bench QUICK=1)")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 1
    runs = []
    for round_number in range(1, args.rounds + 1):
        for mode in args.modes.split(","):
            for victim_of in MODELS:
                runs.append(run_once(round_number, mode, victim_of, args))
                print(_table(runs[-1:]).splitlines()[-1], flush=True)
    print(_table(runs))
    write_report(RESULTS_PATH, {
        "host": platform.node(), "python": platform.python_version(), "when_unix_s": int(time.time()),
        "args": vars(args), "runs": [asdict(r) for r in runs],
    })


if __name__ == "__main__":
    main()
