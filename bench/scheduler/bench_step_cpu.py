"""In-process CPU per token of the generate step path, without gRPC or other processes.

    .venv/bin/python -m bench.scheduler.bench_step_cpu [--seqs 64] [--steps 2000] [--tenants 1] [--backlog 0] [--repeats 3]

One worker's step path driven by hand, as its WorkerLoop drives it: schedule() -> RunStep proto
(attach_codec) -> the pool's planned() and the step metrics -> a StepResult with one token per
sampling sequence, parsed and decoded as the Attach session does -> update_from_output() -> the
pool's completed() (bookkeeping, gauges, chunks to a sink that drops them). A finished sequence is replaced at once, so the running set stays
full (decode steps, with a prompt chunk now and then). Prints process CPU us per generated token
for each repeat: the scheduler-side work of bench_token_path's "scheduler" part minus the
transport, with far less noise on a shared box (no other process involved).
"""

from __future__ import annotations

import argparse
import asyncio
import time

from infermesh.v1 import common_pb2, scheduler_pb2
from services.scheduler import attach_codec, metrics
from services.scheduler.config import SchedulerConfig
from services.scheduler.fair_queue import TenantContext
from services.scheduler.generate_pool import GeneratePool
from services.scheduler.generate_stream import GenerateStream
from services.scheduler.sequence import SamplingParams
from services.scheduler.worker_link import ModelKey


class _DropSink:
    def put_nowait(self, event) -> None:
        pass


class _Loop:
    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler


def _hello(num_seqs: int) -> scheduler_pb2.WorkerHello:
    return scheduler_pb2.WorkerHello(
        worker_id="bench", model=common_pb2.ModelRef(name="mock", version="1"),
        capacity=scheduler_pb2.WorkerCapacity(num_kv_blocks=4096, block_size=16, max_seq_len=2048,
                                              max_num_seqs=num_seqs, max_num_batched_tokens=2048),
        tokenizer=scheduler_pb2.TokenizerSpec(vocab_size=258, eos_token_id=256, bos_token_id=257),
    )


async def run_once(num_seqs: int, num_steps: int, num_tenants: int, max_tokens: int,
                   backlog: int = 0) -> tuple[float, int]:
    """Returns (CPU seconds, tokens delivered)."""
    from services.scheduler.kv_block_manager import KVBlockManager
    from services.scheduler.step_scheduler import StepScheduler
    from services.scheduler.step_scheduler_config import step_scheduler_config

    hello = attach_codec.decode_hello(_hello(num_seqs))
    pool = GeneratePool(ModelKey("mock", "1"), hello, SchedulerConfig(), clock=time.monotonic)
    scheduler = StepScheduler(step_scheduler_config(pool.config, hello.capacity), KVBlockManager(4096, 16),
                              pool.tokenizer, time.monotonic, pool._tenant_service)
    loop = _Loop(scheduler)
    step_metrics = metrics.StepMetrics("mock")
    tenants = [TenantContext(f"t{i}") for i in range(num_tenants)]
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    next_id = iter(range(1, 1 << 30))

    def add() -> None:
        seq_id = next(next_id)
        stream = GenerateStream(seq_id=seq_id, tenant=tenants[seq_id % num_tenants], seed=seq_id,
                                trace_context={}, arrival_s=time.monotonic(), deadline_s=None, events=_DropSink())
        stream.seq = scheduler.add_request(seq_id, tuple(b"stream of the bench "), sampling, stream.tenant,
                                           deadline_s=None)
        pool._streams.add(stream)
        pool._where[seq_id] = loop

    for _ in range(num_seqs + backlog):
        add()
    tokens = 0
    started = time.process_time()
    for step_no in range(num_steps):
        plan = scheduler.schedule()
        command = attach_codec.encode_run_step(plan, pool.streams)
        command.SerializeToString()  # the Attach writer's work
        pool.planned(plan)
        step_metrics.planned(len(plan.seqs), len(plan.preempted_seq_ids))
        result = scheduler_pb2.StepResult(step_id=plan.step_id, outputs=[
            scheduler_pb2.SequenceOutput(seq_id=s.seq_id, token_id=65 + (s.num_generated + step_no) % 26)
            for s in plan.seqs if s.sample])
        # The Attach session's parse and decode.
        outcome = attach_codec.decode_step_result(scheduler_pb2.StepResult.FromString(result.SerializeToString()))
        deltas = scheduler.update_from_output(plan, outcome.token_ids)
        pool.completed(plan, outcome, deltas)
        for delta in deltas:
            tokens += len(delta.token_ids)
            if delta.is_last:
                add()
    return time.process_time() - started, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--tenants", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backlog", type=int, default=0,
                        help="sequences kept waiting beyond --seqs (admission and fairness work every step)")
    parser.add_argument("--quick", action="store_true", help="a quarter of the steps (make bench QUICK=1)")
    args = parser.parse_args()
    if args.quick:
        args.steps = max(1, args.steps // 4)
    import os

    import services
    print(f"services from {services.__file__}, load {os.getloadavg()[0]:.1f}")
    for _ in range(args.repeats):
        cpu_s, tokens = asyncio.run(run_once(args.seqs, args.steps, args.tenants, args.max_tokens, args.backlog))
        print(f"{args.seqs} seqs, {args.tenants} tenants, backlog {args.backlog}: {cpu_s / tokens * 1e6:.2f} us/token "
              f"({tokens} tokens, {cpu_s:.2f} s CPU)")


if __name__ == "__main__":
    main()
