"""A 5 s freeze of the scheduler mid-stream, and what latency admission makes of it afterwards.

    .venv/bin/python -m bench.overload.bench_slo_freeze [--freeze-s 5] [--output PATH]

bench_slo's mock mesh (one scheduler, one mock generator, a gateway admitting on predicted TTFT).
Batch streams keep the worker busy; the scheduler is stopped (SIGSTOP) for --freeze-s while a step is
in flight, then continued, so that step's wall clock reads as seconds. Before and after, an
interactive client (TTFT 200 ms, TPOT 50 ms targets) sends one stream at a time, and the scheduler's
reported least TTFT ("one step alone", GetPressure min_ttft_us) is polled. Before the step-time fit
learned robustly (docs/scheduler.md, "Pressure"), such a freeze set "one step alone" to about a
second and every interactive stream was refused FAILED_PRECONDITION for a while.

Prints the interactive streams' outcomes before and after the freeze by message, and the most and how
long "one step alone" and the mean step time (GetPressure min_service_time_us, which the gateway's
deadline check uses) stayed over 1.5x their values before; writes bench/results/overload_slo_freeze.json.
Takes about 25 s. A freeze of worker_timeout_ms (5 s) or more may instead count the worker gone (it
re-attaches with a fresh fit): 3 s shows the step-time learning alone.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

from bench.harness.results import RESULTS_DIR, write_report
from bench.overload.bench_overload import _commit
from bench.overload.bench_slo import BATCH, INTERACTIVE, mesh, templates
from infermesh.v1 import scheduler_pb2, scheduler_pb2_grpc

RESULTS_PATH = RESULTS_DIR / "overload_slo_freeze.json"
NUM_BATCH_CLIENTS = 8
BEFORE_S = 4.0
AFTER_S = 6.0
POLL_S = 0.02


def _least_times_ms(stub: scheduler_pb2_grpc.SchedulerStub, model: str) -> tuple[float, float] | None:
    """The scheduler's (min_ttft, min_service_time) for `model`, ms: one step alone by the fit, and the
    mean step time the gateway's deadline check uses."""
    try:
        reply = stub.GetPressure(scheduler_pb2.GetPressureRequest(), timeout=1)
    except grpc.RpcError:
        return None
    return next(((m.min_ttft_us / 1000, m.min_service_time_us / 1000) for m in reply.models
                 if m.model.name == model), None)


def _send(generate, template) -> str:
    """"OK" or "CODE: message" with numbers blanked."""
    try:
        for _ in generate(template.body, timeout=template.deadline_s,
                          metadata=(("authorization", f"Bearer {template.api_key}"),)):
            pass
        return "OK"
    except grpc.RpcError as err:
        return f"{err.code().name}: {re.sub(r'[0-9.]+', '#', err.details() or '')[:90]}"


def run(freeze_s: float) -> dict:
    with mesh("mock") as started:
        model, gateway = started["model"], started["slo"][0]
        scheduler_pid = started["pids"]["scheduler"]
        stop = threading.Event()
        channel = grpc.insecure_channel(gateway)
        generate = channel.unary_stream("/infermesh.v1.Inference/Generate")
        batch = templates(model, BATCH, 2)

        def batch_client(index: int) -> None:
            while not stop.is_set():
                _send(generate, batch[index % len(batch)])
                index += NUM_BATCH_CLIENTS

        threads = [threading.Thread(target=batch_client, args=(i,), daemon=True) for i in range(NUM_BATCH_CLIENTS)]
        for thread in threads:
            thread.start()
        interactive = templates(model, INTERACTIVE, 1)
        # (seconds since the freeze ended, (min TTFT, min service time) ms or None), every POLL_S
        samples: list[tuple[float, tuple[float, float] | None]] = []
        thawed = time.monotonic() + BEFORE_S + freeze_s  # until known
        outcomes: dict[str, Counter] = {"before": Counter(), "after": Counter()}

        def poll(stub: scheduler_pb2_grpc.SchedulerStub) -> None:
            while not stop.is_set():
                times_ms = _least_times_ms(stub, model)
                if times_ms is not None:  # None while the scheduler is stopped
                    samples.append((time.monotonic() - thawed, times_ms))
                time.sleep(POLL_S)

        with grpc.insecure_channel(started["scheduler"]) as scheduler_channel:
            poller = threading.Thread(target=poll, args=(scheduler_pb2_grpc.SchedulerStub(scheduler_channel),),
                                      daemon=True)
            poller.start()
            began = time.monotonic()
            index = 0
            while time.monotonic() - began < BEFORE_S:
                outcomes["before"][_send(generate, interactive[index % len(interactive)])] += 1
                index += 1
            os.kill(scheduler_pid, signal.SIGSTOP)
            time.sleep(freeze_s)
            os.kill(scheduler_pid, signal.SIGCONT)
            thawed = time.monotonic()
            while time.monotonic() - thawed < AFTER_S:
                outcomes["after"][_send(generate, interactive[index % len(interactive)])] += 1
                index += 1
            stop.set()
            poller.join()
        channel.close()
    out: dict = {"freeze_s": freeze_s}
    for index, name in enumerate(("min_ttft", "min_service_time")):
        before = sorted(ms[index] for at_s, ms in samples if at_s < 0 and ms)
        typical_ms = before[len(before) // 2] if before else None
        after = [(at_s, ms[index]) for at_s, ms in samples if at_s >= 0 and ms]
        out[f"{name}_before_median_ms"] = typical_ms
        out[f"{name}_after_max_ms"] = max((ms for _, ms in after), default=None)
        out[f"{name}_over_1_5x_until_s"] = max(
            (at_s for at_s, ms in after if typical_ms and ms > 1.5 * typical_ms), default=0.0)
    return {**out,
            "interactive_before": dict(outcomes["before"]), "interactive_after": dict(outcomes["after"]),
            "min_ttft_samples": samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--freeze-s", type=float, default=5.0)
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    args = parser.parse_args()
    result = run(args.freeze_s)
    result.update(benchmark="overload_slo_freeze", commit=_commit(), load_average_1m=os.getloadavg()[0])
    for name, what in (("min_ttft", "one step alone (min_ttft)"), ("min_service_time", "mean step (min_service_time)")):
        print(f"{what}: {result[f'{name}_before_median_ms']} ms before (median), {result[f'{name}_after_max_ms']} ms "
              f"at most after, over 1.5x until {result[f'{name}_over_1_5x_until_s']:.1f} s after the freeze")
    print(f"load {result['load_average_1m']:.1f}")
    for when in ("interactive_before", "interactive_after"):
        print(f"{when}: " + ", ".join(f"{n} {k}" for k, n in Counter(result[when]).most_common()))
    write_report(args.output, result)


if __name__ == "__main__":
    main()
