"""The token fast path benchmark's peer: request-level batching in one process, no gRPC.

    .venv/bin/python -m bench.token_path.request_level_baseline \
        --phases-json '[{"name": "5/s", "rate_per_s": 5, "duration_s": 30, "seed": 1}]'

What the issue compared against (a Ray Serve deployment with `@serve.batch`, 32 at a time),
rebuilt over the worker's own code: the model is loaded from model_repo the way the worker
loads it (`load_model`, 1 torch thread) and every step is the worker's `StepExecutor.run`
(the same paged step and sampling). A batch of up to `max_batch_size` waiting requests is
formed only when the previous batch has ended; its members are prefilled in one step, then
decode together, each dropping out when it has its `max_tokens` (EOS ignored). The load is
generated in the same asyncio loop and reaches the batcher as a method call; latency counts
from each request's scheduled send time, so a step blocking the loop is charged to the
requests it delays. Prints each phase's results as JSON (bench.overload.stats.SendResult fields).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

from bench.harness.send_result import OK, SendResult
from bench.token_path.workload import LoadPhase, TokenRequest, closed_loop_requests
from services.worker.work import RunStep, SequenceOutput, SequenceStep, StageDurations

MAX_BATCH_SIZE = 32  # the issue's @serve.batch(max_batch_size=32)
Clock = Callable[[], float]


class StepRunner(Protocol):
    """What the batcher needs of services.worker.step_executor.StepExecutor."""

    block_size: int
    num_kv_blocks: int

    def run(self, step: RunStep) -> tuple[list[SequenceOutput], StageDurations]: ...

    def forget(self, seq_ids: Sequence[int]) -> None: ...


@dataclass
class Generation:
    """One request in the batcher: its prompt tokens, what it has generated, and when."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    token_ids: list[int] = field(default_factory=list)
    first_token_s: float | None = None  # batcher clock
    done_at_s: float | None = None  # batcher clock, when the last token came
    done: asyncio.Future | None = None  # set to the token ids when max_tokens are generated


class RequestLevelBatcher:
    """Batches of up to `max_batch_size` requests, each formed when the previous one has ended."""

    def __init__(self, runner: StepRunner, max_batch_size: int = MAX_BATCH_SIZE, clock: Clock = time.perf_counter):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self._runner = runner
        self._max_batch_size = max_batch_size
        self._clock = clock
        self._waiting: deque[Generation] = deque()
        self._arrived = asyncio.Event()
        self._next_seq_id = 1
        self.num_steps = 0
        self.batch_sizes: list[int] = []

    def submit(self, prompt_ids: tuple[int, ...], max_tokens: int) -> Generation:
        """Queues a request; `await generation.done` for its tokens."""
        if not prompt_ids or max_tokens < 1:
            raise ValueError(f"need a prompt and max_tokens >= 1, got {len(prompt_ids)} tokens and {max_tokens}")
        generation = Generation(tuple(prompt_ids), max_tokens, done=asyncio.get_running_loop().create_future())
        self._waiting.append(generation)
        self._arrived.set()
        return generation

    async def serve_forever(self) -> None:
        while True:
            if not self._waiting:
                self._arrived.clear()
                await self._arrived.wait()
            await self.run_batch(self._take_batch())

    def _take_batch(self) -> list[Generation]:
        return [self._waiting.popleft() for _ in range(min(self._max_batch_size, len(self._waiting)))]

    async def run_batch(self, batch: list[Generation]) -> None:
        """Prefill every member in one step, then decode the unfinished ones together until none is left."""
        seq_ids = {id(g): self._new_seq_id() for g in batch}
        steps = self._prefill_steps(batch, seq_ids)
        running = batch
        while running:
            outputs, _ = self._runner.run(RunStep(step_id=self.num_steps, seqs=tuple(steps)))
            self.num_steps += 1
            self.batch_sizes.append(len(running))
            now_s = self._clock()
            for generation, output in zip(running, outputs, strict=True):
                if output.token_id is None:
                    raise RuntimeError(f"sequence {output.seq_id} failed in the step: {output.error}")
                generation.token_ids.append(output.token_id)
                if generation.first_token_s is None:
                    generation.first_token_s = now_s
            finished = [g for g in running if len(g.token_ids) >= g.max_tokens]
            self._runner.forget([seq_ids[id(g)] for g in finished])
            for generation in finished:
                generation.done_at_s = now_s
                generation.done.set_result(generation.token_ids)
            running = [g for g in running if len(g.token_ids) < g.max_tokens]
            steps = [self._decode_step(g, seq_ids[id(g)]) for g in running]
            await asyncio.sleep(0)  # let arrivals and finished callers run between steps

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def _prefill_steps(self, batch: list[Generation], seq_ids: dict[int, int]) -> list[SequenceStep]:
        """Each member gets contiguous KV blocks for its whole length up front (a batch never outgrows them)."""
        size = self._runner.block_size
        steps, next_block = [], 0
        for generation in batch:
            num_blocks = -(-(len(generation.prompt_ids) + generation.max_tokens) // size)
            if next_block + num_blocks > self._runner.num_kv_blocks:
                raise ValueError(f"a batch of {len(batch)} needs more than the {self._runner.num_kv_blocks} KV blocks")
            steps.append(SequenceStep(seq_ids[id(generation)], generation.prompt_ids, 0,
                                      new_blocks=tuple(range(next_block, next_block + num_blocks)),
                                      reset_block_table=True, sample=True))
            next_block += num_blocks
        return steps

    @staticmethod
    def _decode_step(generation: Generation, seq_id: int) -> SequenceStep:
        position = len(generation.prompt_ids) + len(generation.token_ids) - 1
        return SequenceStep(seq_id, (generation.token_ids[-1],), position, sample=True,
                            num_generated=len(generation.token_ids))


# -- load, in the same loop ---------------------------------------------------------


async def open_loop(batcher: RequestLevelBatcher, requests: Sequence[TokenRequest], encode, clock: Clock
                    ) -> list[SendResult]:
    """Submits each request at its scheduled time; results with times from the run's start."""
    origin_s = clock()
    pending = []
    for request in requests:
        while (delay_s := origin_s + request.scheduled_s - clock()) > 0:
            await asyncio.sleep(delay_s)
        sent_s = clock() - origin_s
        pending.append((request, sent_s, batcher.submit(encode(request.prompt), request.max_tokens)))
    await asyncio.gather(*(g.done for _, _, g in pending))
    return [SendResult("baseline", r.scheduled_s, sent_s, g.done_at_s - origin_s, OK,
                       ttft_s=g.first_token_s - origin_s - r.scheduled_s, num_tokens=len(g.token_ids))
            for r, sent_s, g in pending]


async def closed_loop(batcher: RequestLevelBatcher, requests: Sequence[TokenRequest], concurrency: int,
                      duration_s: float, encode, clock: Clock) -> tuple[list[SendResult], float]:
    """`concurrency` clients cycling through `requests`; the streams that ended inside the window."""
    origin_s = clock()
    end_s = origin_s + duration_s
    results: list[SendResult] = []
    counter = iter(range(1 << 62))

    async def client() -> None:
        while clock() < end_s:
            request = requests[next(counter) % len(requests)]
            sent_s = clock() - origin_s
            generation = batcher.submit(encode(request.prompt), request.max_tokens)
            await generation.done
            if generation.done_at_s > end_s:
                return
            results.append(SendResult("baseline", sent_s, sent_s, generation.done_at_s - origin_s, OK,
                                      ttft_s=generation.first_token_s - origin_s - sent_s,
                                      num_tokens=len(generation.token_ids)))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return results, clock() - origin_s


# -- the process ---------------------------------------------------------------------


def load_tinylm(model_repo: str, num_threads: int):
    """The worker's load path for tinylm: thread settings first, then load_model and a StepExecutor."""
    from services.worker.thread_settings import export_thread_env, set_library_threads

    export_thread_env(num_threads)
    set_library_threads(num_threads)
    from services.worker.repository.loader import load_model
    from services.worker.step_executor import StepExecutor

    model = load_model(model_repo, "tinylm", "1")
    envelope, spec = model.manifest.envelope, model.manifest.generator
    executor = StepExecutor(model.generator, envelope.num_kv_blocks, envelope.block_size)
    bos = spec.tokenizer.bos_token_id

    def encode(text: str) -> tuple[int, ...]:
        return ((bos,) if bos >= 0 else ()) + tuple(text.encode())

    return executor, encode


async def run_phases(phases: Sequence[LoadPhase], model_repo: str, num_threads: int, max_batch_size: int
                     ) -> list[dict]:
    """Each phase's results (SendResult fields), elapsed time, CPU and step counts, in order."""
    executor, encode = load_tinylm(model_repo, num_threads)
    batcher = RequestLevelBatcher(executor, max_batch_size)
    engine = asyncio.create_task(batcher.serve_forever())
    clock = time.perf_counter
    await closed_loop(batcher, closed_loop_requests(8, 1000), 8, 1.0, encode, clock)  # warm-up
    reports = []
    for phase in phases:
        num_steps_before, num_sizes_before = batcher.num_steps, len(batcher.batch_sizes)
        cpu_before_s = time.process_time()
        load_average = os.getloadavg()
        if phase.open_loop:
            results = await open_loop(batcher, phase.requests(), encode, clock)
            elapsed_s = max((r.done_s for r in results), default=0.0)
        else:
            results, elapsed_s = await closed_loop(batcher, phase.requests(), phase.concurrency, phase.duration_s,
                                                   encode, clock)
        sizes = batcher.batch_sizes[num_sizes_before:]
        reports.append({"phase": asdict(phase), "results": [asdict(r) for r in results], "elapsed_s": elapsed_s,
                        "cpu_s": time.process_time() - cpu_before_s, "load_average": load_average,
                        "num_steps": batcher.num_steps - num_steps_before,
                        "mean_running": sum(sizes) / max(1, len(sizes))})
    engine.cancel()
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases-json", required=True, help="a JSON list of LoadPhase fields")
    parser.add_argument("--num-threads", type=int, default=1, help="torch/OpenMP threads")
    parser.add_argument("--max-batch-size", type=int, default=MAX_BATCH_SIZE)
    parser.add_argument("--model-repo", default=os.environ.get("MESH_MODEL_REPO", "model_repo"))
    args = parser.parse_args()
    phases = [LoadPhase(**fields) for fields in json.loads(args.phases_json)]
    reports = asyncio.run(run_phases(phases, args.model_repo, args.num_threads, args.max_batch_size))
    json.dump(reports, sys.stdout)


if __name__ == "__main__":
    main()
