"""Generate requests for one model version: its generator workers, where each sequence runs, and failover.

Each worker has its own KV blocks, so each gets its own `StepScheduler` (continuous batching,
chunked prefill, preemption by recompute) and its own step loop (step_loop.py: plan -> send ->
overlap -> await -> update; with `--pipelined-steps on`, steps planned ahead and sent K at a time,
step_pacing.py). The pool is the loops' `StepSink`: planned steps and results come back to it, and
it hands them to the clients' streams (generate_stream.py) and the gauges (metrics.py). A new
sequence goes where `--routing` says (prefix_routing.py: by default the worker that computes least
before its first token, its cached prefix counted).

Failover: when a worker's stream breaks, its scheduler's sequences are evicted
with what they generated so far and adopted by the other workers, which recompute
prompt + generated tokens; the client's stream continues at the next index, with
nothing repeated or skipped. With no worker left they are held until one attaches,
at most until their deadline (or `orphan_grace_ms` without one). A draining
worker finishes its running sequences and hands its waiting ones to the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from services.common import errors
from services.common.clock import Clock
from services.common.log_context import clean_context
from services.scheduler import metrics
from services.scheduler.attach_types import StepOutcome, WorkerHello
from services.scheduler.config import SchedulerConfig
from services.scheduler.fair_queue import Priority
from services.scheduler.generate_stream import ClientStreams, GenerateStream, StreamEvent, deadline_error
from services.scheduler.kv_block_manager import KVBlockManager
from services.scheduler.model_text import build_model_text
from services.scheduler.prefix_cache import PrefixCacheKeys
from services.scheduler.prefix_routing import Route, Router, RoutingMode, WorkerLoad, WorkerView
from services.scheduler.pressure import ModelPressure, generator_pressure
from services.scheduler.sequence import AbortReason, SamplingParams, Sequence
from services.scheduler.step_loop import WorkerLoop, is_pipelined, steps_per_command
from services.scheduler.step_plan import SequenceDelta, StepPlan
from services.scheduler.step_scheduler import StepScheduler, StepSchedulerFactory
from services.scheduler.step_scheduler_config import step_scheduler_config
from services.scheduler.tenant_service import TenantService
from services.scheduler.worker_features import WorkerFeature, described, needed_features
from services.scheduler.worker_link import ModelKey, WorkerLink

log = logging.getLogger(__name__)


class GeneratePool:
    """One model version's generate sequences over its generator workers; the workers' `StepSink`."""

    def __init__(self, model: ModelKey, hello: WorkerHello, config: SchedulerConfig,
                 clock: Clock = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 step_scheduler: StepSchedulerFactory = StepScheduler) -> None:
        """`sleep`: waits out `clock` seconds (a fake clock's in tests); `step_scheduler`: makes each
        worker's StepScheduler (a benchmark's baseline may bring its own)."""
        spec = hello.tokenizer
        self.model = model
        self.config = config
        self.clock = clock
        self.sleep = sleep
        self._make_step_scheduler = step_scheduler
        # Built by the Attach session (HF off the event loop); a hello made in-process (tests, benchmarks) has none.
        self.text = hello.text if hello.text is not None else build_model_text(spec)
        self.tokenizer = self.text.tokenizer
        self._loops: dict[str, WorkerLoop] = {}
        # One set of tenant service counters for all of this model's workers (generate fairness).
        self._tenant_service = TenantService()
        self._where: dict[int, WorkerLoop] = {}
        self._streams = ClientStreams(model, clock, on_ended=self._forget_where)
        # Evicted sequences no worker could take, with when they started waiting.
        self._held: dict[int, tuple[Sequence, float]] = {}
        self._hold_timer: asyncio.Task[None] | None = None
        # Blocks named as each worker's StepScheduler names them (tenant salt, public prefixes).
        prefix_keys = PrefixCacheKeys.of(self.tokenizer.encode(text) for text in config.public_prefix_texts())
        self._router: Router[WorkerLoop] = Router(RoutingMode(config.routing), clock,
                                                   prefix_keys.block_hashes if config.prefix_cache else None)
        # cache_aware: sequences routed with prompt tokens still to compute, by seq_id: where they went,
        # and the tokens routing counted as cached there (see _views).
        self._prefilling: dict[int, tuple[WorkerLoop, Sequence, int]] = {}
        # Looked up once: the step loops update them every step.
        self._step_metrics = metrics.StepMetrics(model.name)
        self._gauges = metrics.GenerateGauges(model.name)
        self._worker_gauges: dict[str, metrics.WorkerGauges] = {}  # by link_id

    # -- workers -------------------------------------------------------------

    def add_worker(self, link: WorkerLink) -> None:
        capacity = link.hello.capacity
        kv = KVBlockManager(capacity.num_kv_blocks, capacity.block_size or 16)
        scheduler = self._make_step_scheduler(step_scheduler_config(self.config, capacity), kv, self.tokenizer,
                                              self.clock, self._tenant_service)
        self._worker_gauges[link.link_id] = metrics.WorkerGauges(self.model.name, link.worker_id)
        pipelined = is_pipelined(self.config, capacity)
        self._loops[link.link_id] = WorkerLoop(
            link, scheduler, self, sequences=self._streams.by_id, step_metrics=self._step_metrics,
            pipelined=pipelined, steps_per_command=steps_per_command(self.config, capacity),
            clock=self.clock, sleep=self.sleep)
        if self._held:
            held = [seq for seq, _ in self._held.values()]
            self._held.clear()
            log.info("worker %s adopts %d held sequences of %s", link.worker_id, len(held), self.model)
            self._place(held)
        self._update_gauges()

    def drain_worker(self, link: WorkerLink) -> None:
        """The worker finishes its running sequences; its waiting ones move to the others."""
        loop = self._loops.get(link.link_id)
        if loop is None:
            return
        if self._usable_loops():
            self._place(loop.scheduler.evict_waiting(), fallback=loop)
        loop.wake()

    def remove_worker(self, link: WorkerLink) -> None:
        loop = self._loops.pop(link.link_id, None)
        if loop is None:
            return
        loop.attached = False
        loop.wake()
        self._router.forget_worker(loop)
        gauges = self._worker_gauges.pop(link.link_id)
        if not any(other.link.worker_id == link.worker_id for other in self._loops.values()):
            gauges.remove()  # no stale series for a worker that is gone (its prefix cache index goes with it)
        evicted = [seq for seq in loop.scheduler.evict_all() if seq.seq_id in self._streams]
        if evicted:
            # A worker that said Draining first left on purpose (a move to a scheduler with none of
            # this model's workers: services/worker/attach_client.py); one that did not is lost.
            log.log(logging.INFO if link.draining else logging.WARNING,
                    "worker %s of %s %s: recomputing %d sequences elsewhere", link.worker_id, self.model,
                    "left" if link.draining else "gone", len(evicted))
        self._place(evicted)
        self._update_gauges()

    def num_sequences_on(self, link: WorkerLink) -> int:
        """Unfinished sequences the worker holds or will run (0 for a worker not here)."""
        loop = self._loops.get(link.link_id)
        return 0 if loop is None else loop.scheduler.num_unfinished

    @property
    def streams(self) -> Mapping[int, GenerateStream]:
        """The unfinished sequences' streams by seq_id."""
        return self._streams.by_id

    @property
    def workers(self) -> list[WorkerLink]:
        return [loop.link for loop in self._loops.values()]

    @property
    def queue_depth(self) -> int:
        return sum(loop.scheduler.num_waiting for loop in self._loops.values()) + len(self._held)

    def max_seq_len(self) -> int:
        return min((loop.scheduler.config.max_seq_len for loop in self._loops.values()), default=1 << 30)

    def pressure(self) -> ModelPressure:
        pressure = generator_pressure([loop.scheduler for loop in self._loops.values()])
        # A draining worker serves nothing new (and workers choosing a scheduler must not count it).
        num_usable = len(self._usable_loops())
        if self._held or num_usable != pressure.num_workers:
            pressure = dataclasses.replace(pressure, queue_depth=pressure.queue_depth + len(self._held),
                                           num_workers=num_usable)
        return pressure

    def kv_usage(self) -> float:
        return self.pressure().kv_usage

    # -- sequences -----------------------------------------------------------

    def submit(self, stream: GenerateStream, prompt_ids: tuple[int, ...], sampling: SamplingParams,
               delivered_token_ids: tuple[int, ...] = (), ttft_target_s: float | None = None,
               tpot_target_s: float | None = None, *, ttft_prediction_factor: float = 1.0) -> None:
        """`delivered_token_ids`: a continuation's tokens (StepScheduler.add_request).
        `ttft_target_s`: the request's TTFT target (GenerateRequest.objectives); a new stream goes to
        the routed worker if it is predicted to meet it, else to another that is, else is refused
        (latency_predictor.py): FailedPrecondition below one step alone, ResourceExhausted with the
        excess as retry hint otherwise. A continuation already had its first token: no target.
        `ttft_prediction_factor`: what the gateway multiplies the predictions by where it judges them
        (ScheduleGenerateRequest.ttft_prediction_factor). Below 1 they are judged here the same way, so this
        check does not refuse what the gateway admitted because its streams start sooner than predicted. Above
        1 it is not applied: this check is a backstop for a queue that grew since the gateway's last poll, and
        the factor was learned against the predictions of whichever schedulers served the class, not against
        this one's now (a scheduler just restarted predicts from its own fresh state; judged times the factor
        its predecessor earned, it refused streams the gateway had admitted in a reliability test).
        `tpot_target_s`: its TPOT target, which paces the steps it runs in (tpot_pacing.py); below one
        step alone, FailedPrecondition at once."""
        needed = needed_features(sampling)
        loops = self._usable_loops(needed, sampling.lora_adapter)
        if not loops and not self._usable_loops():
            raise errors.Unavailable(f"no worker serves model {self.model}", retry_after_s=1.0)
        if not loops and sampling.lora_adapter and not self._usable_loops(lora_adapter=sampling.lora_adapter):
            raise errors.Unavailable(f"no worker of model {self.model} serves LoRA adapter {sampling.lora_adapter!r} "
                                     "now", retry_after_s=1.0)
        if not loops:
            missing = {feature for feature in needed if not self.honours(feature)} or needed
            raise errors.Unavailable(f"no worker of model {self.model} honours {described(missing)}: its workers "
                                     f"are older than this scheduler, or sample without it", retry_after_s=1.0)
        max_seq_len = self.max_seq_len()
        if len(prompt_ids) + sampling.num_output_positions > max_seq_len:
            raise errors.InvalidArgument(
                f"prompt of {len(prompt_ids)} tokens plus max_tokens {sampling.max_tokens} exceeds the "
                f"model's max sequence length {max_seq_len}"
            )
        route = self._router.choose(prompt_ids + delivered_token_ids, stream.tenant.tenant_id, self._views(loops),
                                    sampling.lora_adapter)
        if tpot_target_s is not None and not delivered_token_ids:
            self._check_tpot_meetable(loops, tpot_target_s)
        if ttft_target_s is not None and not delivered_token_ids:
            route = self._meeting(route, loops, len(prompt_ids), Priority(stream.tenant.priority), ttft_target_s,
                                  min(1.0, ttft_prediction_factor))
        loop = route.worker
        stream.seq = loop.scheduler.add_request(
            stream.seq_id, prompt_ids, sampling, stream.tenant, deadline_s=stream.deadline_s,
            delivered_token_ids=delivered_token_ids, block_hashes=route.block_hashes, tpot_target_s=tpot_target_s,
        )
        self._note_prefilling(stream.seq, route)
        stream.resumed = bool(delivered_token_ids)
        self._streams.add(stream)
        self._where[stream.seq_id] = loop
        loop.wake()
        self._update_gauges()

    def _check_tpot_meetable(self, loops: list[WorkerLoop], tpot_target_s: float) -> None:
        """FailedPrecondition when the TPOT target is below one step alone on the fastest worker: no token
        can follow another sooner."""
        least_s = min(loop.scheduler.latency.min_ttft_s() for loop in loops)
        if tpot_target_s < least_s:
            raise errors.FailedPrecondition(
                f"TPOT target {tpot_target_s * 1000:g} ms cannot be met by model {self.model}: one step alone "
                f"takes {least_s * 1000:.1f} ms on its fastest worker")

    def _meeting(self, route: Route[WorkerLoop], loops: list[WorkerLoop], num_prompt_tokens: int,
                 priority: Priority, ttft_target_s: float, factor: float = 1.0) -> Route[WorkerLoop]:
        """`route` if its worker is predicted to meet the TTFT target (its cache hit counted), else the
        worker predicted fastest if that one meets it, else a worker with nothing waiting whose one-token
        prediction meets it (there the stream starts on the next steps: a miss is its own prompt's prefill,
        not overload, and no retry would fare better); raises when none does. Each prediction is judged
        times `factor`, the gateway's correction of them."""
        def predicted_s(loop: WorkerLoop, num_cached: int) -> float:
            return factor * loop.scheduler.predicted_latency(priority, max(1, num_prompt_tokens - num_cached)).ttft_s

        routed_s = predicted_s(route.worker, route.num_cached_tokens)
        if routed_s <= ttft_target_s:
            return route
        best = min(loops, key=lambda loop: predicted_s(loop, 0))
        best_s = predicted_s(best, 0)
        if best_s <= ttft_target_s:
            return Route(worker=best, num_cached_tokens=0)
        least_s = min(loop.scheduler.latency.min_ttft_s() for loop in loops)
        if ttft_target_s < least_s:
            raise errors.FailedPrecondition(
                f"TTFT target {ttft_target_s * 1000:g} ms cannot be met by model {self.model}: one step alone "
                f"takes {least_s * 1000:.1f} ms on its fastest worker")
        for loop in (route.worker, *loops):
            if loop.scheduler.num_waiting == 0 and loop.scheduler.predicted_latency(priority, 1).ttft_s <= ttft_target_s:
                return route if loop is route.worker else Route(worker=loop, num_cached_tokens=0)
        soonest_s = min(routed_s, best_s)
        retry_after_s = max(soonest_s - ttft_target_s, 0.05)
        raise errors.ResourceExhausted(
            f"overloaded: model {self.model} would start this stream in {soonest_s * 1000:.0f} ms at best, past "
            f"its TTFT target {ttft_target_s * 1000:g} ms; retry after {retry_after_s:.2f} s",
            retry_after_s=retry_after_s)

    def abort(self, stream: GenerateStream) -> None:
        """The client went away: the sequence is dropped and its blocks freed now."""
        if not self._streams.close(stream.seq_id):
            return
        self._drop(stream.seq_id)

    def hand_over(self, stream: GenerateStream, error: errors.InfermeshError) -> bool:
        """Ends the stream with `error` (tokens already streamed stay delivered; nothing follows them)
        and drops its sequence, blocks freed now: the scheduler is draining and the caller resumes
        the stream elsewhere. False when it had already finished."""
        if not self._streams.close(stream.seq_id):
            return False
        self._drop(stream.seq_id)
        stream.events.put_nowait(StreamEvent(error=error))
        return True

    def _drop(self, seq_id: int) -> None:
        loop = self._where.pop(seq_id, None)
        if loop is not None:
            loop.scheduler.abort(seq_id, AbortReason.CANCELLED)
            loop.wake()  # tells the worker to forget the sequence even if nothing else runs
        self._held.pop(seq_id, None)
        self._update_gauges()

    # -- StepSink: what the step loops report -----------------------------------

    def planned(self, plan: StepPlan) -> None:
        self._streams.planned(plan)

    def completed(self, plan: StepPlan, outcome: StepOutcome, deltas: list[SequenceDelta]) -> None:
        self._streams.add_compute(plan, outcome.worker_total_s)
        self._update_gauges()
        self._streams.deliver(deltas, outcome.failures)

    # -- internals ---------------------------------------------------------

    def _forget_where(self, seq_id: int) -> None:
        """A stream ended (its sequence finished, failed or expired): the sequence is on no worker."""
        self._where.pop(seq_id, None)

    def honours(self, feature: WorkerFeature) -> bool:
        """Whether a worker that takes new sequences declared `feature` (WorkerHello.features)."""
        return bool(self._usable_loops(frozenset((feature,))))

    def _usable_loops(self, needed: frozenset[WorkerFeature] = frozenset(), lora_adapter: str = "") -> list[WorkerLoop]:
        """Workers that take new sequences, declared every feature in `needed`, and serve `lora_adapter`."""
        return [loop for loop in self._loops.values() if loop.link.usable and needed <= loop.link.hello.features
                and (not lora_adapter or lora_adapter in loop.link.hello.lora_adapters)]

    def _note_prefilling(self, seq: Sequence, route: Route[WorkerLoop]) -> None:
        if self._router.mode is RoutingMode.CACHE_AWARE:
            self._prefilling[seq.seq_id] = (route.worker, seq, route.num_cached_tokens)

    def _views(self, loops: list[WorkerLoop]) -> list[WorkerView[WorkerLoop]]:
        """What routing knows of each worker: its load, and its block manager for cached prefixes.

        Prompt tokens still to compute are summed over the sequences routed that have not finished
        their prefill (dropped here once they have, or left): the waiting queue, not every sequence.
        One holding no blocks yet counts its tokens less what routing found cached for it, since
        the step scheduler looks its prefix up only when it admits it. A sequence preempted after
        its prefill is not counted again (rare, and it recomputes on the worker it is on)."""
        num_prefill = dict.fromkeys(loops, 0)
        done = []
        for seq_id, (where, seq, num_cached) in self._prefilling.items():
            num_uncomputed = seq.num_uncomputed_tokens
            if num_uncomputed <= 1 or seq.is_finished() or self._where.get(seq_id) is not where:
                done.append(seq_id)  # decoding (one token a step), finished, or moved
            elif where in num_prefill:
                num_prefill[where] += max(0, num_uncomputed - (num_cached if seq.num_computed_tokens == 0 else 0))
        for seq_id in done:
            del self._prefilling[seq_id]
        views = []
        for loop in loops:
            scheduler = loop.scheduler
            load = WorkerLoad(num_running=scheduler.num_running,
                              num_waiting=scheduler.num_unfinished - scheduler.num_running,
                              max_num_seqs=scheduler.config.max_num_seqs, num_prefill_tokens=num_prefill[loop],
                              kv_usage=scheduler.kv.usage)
            views.append(WorkerView(loop, load, scheduler.kv))
        return views

    def _place(self, seqs: list[Sequence], fallback: WorkerLoop | None = None) -> None:
        """Hands evicted sequences to usable workers that declared the features each needs, as
        `--routing` says (their generated tokens count as prompt: they are recomputed); one no such
        worker can take goes back to `fallback` (a draining worker finishes it), else is held."""
        now = self.clock()
        for seq in seqs:
            loops = self._usable_loops(needed_features(seq.sampling), seq.sampling.lora_adapter)
            if not loops and fallback is not None:
                fallback.scheduler.adopt(seq)
                self._where[seq.seq_id] = fallback
                continue
            if not loops:
                self._held[seq.seq_id] = (seq, now)
                continue
            route = self._router.choose(seq.token_ids(0, seq.num_tokens), seq.tenant.tenant_id, self._views(loops),
                                        seq.sampling.lora_adapter)
            loop = route.worker
            loop.scheduler.adopt(seq, route.block_hashes)
            self._note_prefilling(seq, route)
            self._where[seq.seq_id] = loop
            loop.wake()
        if self._held and (self._hold_timer is None or self._hold_timer.done()):
            self._hold_timer = asyncio.create_task(self._expire_held(), context=clean_context())  # not the request's

    async def _expire_held(self) -> None:
        """Fails held sequences whose deadline (or, without one, the orphan grace) passes before a
        worker attaches. The deadline is the client's promise to wait: a replacement worker that
        takes longer than the grace to start (a slow box, a model load) still gets the stream."""
        grace_s = self.config.orphan_grace_ms / 1000
        while self._held:
            now = self.clock()
            next_s = None
            for seq_id, (seq, held_s) in list(self._held.items()):
                give_up_s = held_s + grace_s if seq.deadline_s is None else seq.deadline_s
                if now >= give_up_s:
                    del self._held[seq_id]
                    stream = self._streams.get(seq_id)
                    if stream is not None:
                        expired = seq.deadline_s is not None and now >= seq.deadline_s
                        self._streams.fail(stream, deadline_error(stream) if expired else errors.Unavailable(
                            f"no worker serves model {self.model}", retry_after_s=1.0))
                else:
                    next_s = give_up_s if next_s is None else min(next_s, give_up_s)
            self._update_gauges()
            if next_s is not None:
                await self.sleep(max(0.0, next_s - now))

    def _update_gauges(self) -> None:
        schedulers = [loop.scheduler for loop in self._loops.values()]
        held = [seq for seq, _ in self._held.values()]

        def num_waiting_of(priority: Priority) -> int:
            return sum(s.num_waiting_of(priority) for s in schedulers) + sum(s.priority == priority for s in held)

        self._gauges.publish(sum(s.num_running for s in schedulers),
                             sum(s.num_waiting for s in schedulers) + len(self._held), num_waiting_of)
        for link_id, loop in self._loops.items():
            kv = loop.scheduler.kv
            self._worker_gauges[link_id].publish(kv.usage, loop.scheduler.cache_stats, kv.num_cached_blocks,
                                                 kv.num_evictions)
