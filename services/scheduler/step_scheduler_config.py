"""What one worker's StepScheduler may do: its limits and policies, validated once.

`StepSchedulerConfig` is the StepScheduler's own (tests and benchmarks build it directly);
`step_scheduler_config()` derives it from the scheduler's flags and a worker's hello.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.attach_types import WorkerCapacity
from services.scheduler.config import SchedulerConfig
from services.scheduler.tenant_service import ServiceCost


@dataclass(frozen=True)
class StepSchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    # Prompt + output tokens of one sequence.
    max_seq_len: int
    # Waiting (never scheduled) sequences; beyond it add_request raises ResourceExhausted.
    max_num_waiting: int = 1024
    # Most tokens one sequence computes in one step; 0: up to the whole budget.
    max_prefill_chunk_tokens: int = 0
    # False: a waiting prompt is admitted only when it fits the step whole (the benchmark's baseline).
    enable_chunked_prefill: bool = True
    # Prompts needing more than one chunk that may prefill at once (vLLM's max_long_partial_prefills);
    # others wait, and short prompts behind them are admitted meanwhile. 0: no limit.
    max_long_partial_prefills: int = 1
    # Deficit round robin credit per visit, in prompt tokens (the waiting queue's own order; admission
    # picks tenants by service counter and only uses the queue's per-tenant order).
    tenant_quantum_tokens: int = 256
    # Service counter units per prompt token computed and per output token sampled (VTC's weights).
    service_cost: ServiceCost = ServiceCost()
    # A tenant below its weighted share of max_num_seqs that waits preempts a same-class tenant above
    # its share; a sequence runs at least this long before it can be preempted so (anti-thrash).
    enable_fairness_preemption: bool = True
    fairness_min_run_s: float = 0.1
    # Service units by which a waiting tenant below its share of max_num_seqs counts as less served
    # at admission (TenantService.admission_key): slots stay at the shares unless one tenant is clearly
    # less served, instead of changing hands by admission and back by fairness preemption.
    fairness_share_credit: float = 200.0
    # Admission keeps this fraction of blocks free, so running sequences can grow without preempting.
    kv_watermark: float = 0.01
    # Step time assumed before any is measured, and the weight of each new measurement.
    initial_step_time_s: float = 0.02
    step_time_ewma_alpha: float = 0.2
    # Reuse the resident KV blocks of a sequence's prefix (prefix_cache.py); False: compute every token.
    enable_prefix_cache: bool = True
    # Prompt prefixes (text) whose full blocks every tenant shares; all others are salted per tenant.
    public_prefix_texts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_seq_len", "max_num_waiting", "tenant_quantum_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_long_partial_prefills < 0:
            raise ValueError(f"max_long_partial_prefills must be >= 0, got {self.max_long_partial_prefills}")
        if self.max_prefill_chunk_tokens < 0:
            raise ValueError(f"max_prefill_chunk_tokens must be >= 0, got {self.max_prefill_chunk_tokens}")
        if not 0 <= self.kv_watermark < 1:
            raise ValueError(f"kv_watermark must be in [0, 1), got {self.kv_watermark}")
        if self.fairness_min_run_s < 0:
            raise ValueError(f"fairness_min_run_s must be >= 0, got {self.fairness_min_run_s}")
        if self.fairness_share_credit < 0:
            raise ValueError(f"fairness_share_credit must be >= 0, got {self.fairness_share_credit}")
        if not 0 < self.step_time_ewma_alpha <= 1:
            raise ValueError(f"step_time_ewma_alpha must be in (0, 1], got {self.step_time_ewma_alpha}")


def step_scheduler_config(config: SchedulerConfig, capacity: WorkerCapacity) -> StepSchedulerConfig:
    """One worker's StepSchedulerConfig: the scheduler's flags capped by what the worker declared in its hello."""

    def smaller(ours: int, theirs: int, default: int) -> int:
        return min(v for v in (ours, theirs) if v) if (ours or theirs) else default

    block_size = capacity.block_size or 16
    max_seq_len = min(capacity.max_seq_len or 1 << 30, capacity.num_kv_blocks * block_size)
    return StepSchedulerConfig(
        max_num_seqs=smaller(config.max_num_seqs, capacity.max_num_seqs, 32),
        max_num_batched_tokens=smaller(config.max_num_batched_tokens, capacity.max_num_batched_tokens, 512),
        max_seq_len=max_seq_len,
        max_num_waiting=config.max_queue_size,
        max_prefill_chunk_tokens=config.long_prefill_chunk_tokens,
        enable_chunked_prefill=config.long_prefill_chunk_tokens > 0,
        max_long_partial_prefills=config.max_long_partial_prefills,
        enable_fairness_preemption=config.fairness_preemption,
        fairness_min_run_s=config.fairness_min_run_ms / 1000,
        fairness_share_credit=config.fairness_share_credit,
        enable_prefix_cache=config.prefix_cache,
        public_prefix_texts=config.public_prefix_texts(),
    )
