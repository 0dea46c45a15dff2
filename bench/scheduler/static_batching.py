"""Static batching: bench_scheduler's baseline for continuous batching, owned by the benchmark.

    .venv/bin/python -m bench.scheduler.static_batching [--static-batch-padding true|false] [scheduler flags]

Runs the real scheduler (python -m services.scheduler, the same flags) with each generator
worker's StepScheduler replaced by `StaticBatchScheduler`: once a running set has sampled a token,
nothing new is admitted until all of it finished. With padding (the default), a member that
finished stays in the batch as padding until the whole batch ends - its last position recomputed,
the sample thrown away, its blocks kept - as a fixed-shape batch computes it (FasterTransformer, HF
generate); `--static-batch-padding false` lets finished members drop out of the steps.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping, Sequence

from services.common.clock import Clock
from services.common.config import load_config
from services.common.server import run
from services.scheduler.config import SchedulerConfig
from services.scheduler.kv_block_manager import KVBlockManager
from services.scheduler.sequence import Sequence as Seq
from services.scheduler.sequence import SequenceStatus
from services.scheduler.server import SchedulerService
from services.scheduler.step_builder import StepBuilder
from services.scheduler.step_plan import SequenceDelta, SequenceStep, StepPlan
from services.scheduler.step_scheduler import StepScheduler
from services.scheduler.step_scheduler_config import StepSchedulerConfig
from services.scheduler.tenant_service import TenantService
from services.scheduler.tokenizer import Tokenizer

PADDING_FLAG = "--static-batch-padding"


class StaticBatchScheduler(StepScheduler):
    def __init__(self, config: StepSchedulerConfig, kv: KVBlockManager, tokenizer: Tokenizer, clock: Clock,
                 service: TenantService | None = None, *, padding: bool = True) -> None:
        super().__init__(config, kv, tokenizer, clock, service)
        self.padding = padding
        # The running set has begun decoding: admission waits for it to empty.
        self._batch_closed = False
        # Finished members still computed until the batch ends (they keep their blocks, and the
        # worker its block tables, until then).
        self._padding: list[Seq] = []

    def schedule(self) -> StepPlan:
        """StepScheduler.schedule() with the batch's padding computed after the running set, and no
        admission once the batch has begun decoding."""
        self._check_nothing_in_flight()
        now = self._clock()
        expired = self._abort_expired(now)
        step = StepBuilder(self.config.max_num_batched_tokens, self._service)
        self._schedule_running(step)
        padding = self._padding_steps(step)
        if not step.preempted and not self._batch_closed:
            self._admit(step, now)
        return self._issue((*step.build_steps(), *padding), now, expired=expired, preempted=step.preempted)

    def schedule_ahead(self) -> StepPlan | None:
        """Never: whether the batch closed or ended, and what it pads, is known from results only."""
        return None

    def _padding_steps(self, step: StepBuilder) -> list[SequenceStep]:
        """Each padding member's last cached position computed again, out of the step's budget."""
        if not self._running:
            self._batch_closed = False
            return []
        steps = []
        for seq in self._padding:
            if step.token_budget == 0:
                break
            last = seq.num_computed_tokens - 1
            steps.append(SequenceStep(
                seq_id=seq.seq_id, token_ids=seq.token_ids(last, last + 1), start_position=last, new_blocks=(),
                reset_block_table=False, sample=True, sampling=seq.sampling, num_generated=seq.num_generated))
            step.token_budget -= 1
        return steps

    def update_from_output(self, plan: StepPlan, sampled_token_ids: Mapping[int, int],
                           step_time_s: float | None = None) -> list[SequenceDelta]:
        if any(step.sample and step.seq_id in sampled_token_ids for step in plan.seqs):
            self._batch_closed = True
        return super().update_from_output(plan, sampled_token_ids, step_time_s)

    def evict_all(self) -> list[Seq]:
        for pad in self._padding:
            self.kv.free(pad.seq_id)
        self._padding.clear()
        return super().evict_all()

    def _retire(self, seq: Seq) -> None:
        super()._retire(seq)
        if not self._running and self._padding:  # the batch ended: its padding goes too
            pads, self._padding = self._padding, []
            for pad in pads:
                super()._release(pad)

    def _release(self, seq: Seq) -> None:
        """A running member leaving a batch that still runs stays in it as padding."""
        if (self.padding and seq.status is SequenceStatus.RUNNING and self._running
                and seq.num_computed_tokens > 0):
            self._padding.append(seq)
        else:
            super()._release(seq)


def split_padding_flag(argv: Sequence[str]) -> tuple[bool, list[str]]:
    """(padding, the scheduler's own flags): `--static-batch-padding true|false` taken out of argv."""
    rest = list(argv)
    if PADDING_FLAG not in rest:
        return True, rest
    at = rest.index(PADDING_FLAG)
    value = rest[at + 1].lower() if at + 1 < len(rest) else ""
    if value not in ("true", "false"):
        raise SystemExit(f"{PADDING_FLAG} takes true or false, got {value!r}")
    del rest[at:at + 2]
    return value == "true", rest


def main() -> None:
    padding, argv = split_padding_flag(sys.argv[1:])

    def load() -> tuple[SchedulerConfig, SchedulerService]:
        config = load_config(SchedulerConfig, "scheduler", argv)
        return config, SchedulerService(config, functools.partial(StaticBatchScheduler, padding=padding))

    run("scheduler", load)


if __name__ == "__main__":
    main()
