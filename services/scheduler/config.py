"""Scheduler configuration (flags / INFERMESH_SCHEDULER_* variables)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from services.common.config import ConfigError, ServerSettings, require, setting
from services.scheduler.prefix_routing import RoutingMode


@dataclass(frozen=True)
class SchedulerConfig(ServerSettings):
    max_queue_delay_ms: float = setting(5.0, "classify: longest a request waits for its batch to fill")
    preferred_batch_sizes: tuple[int, ...] = setting((), "classify: batch sizes to prefer, comma-separated")
    max_batch_size: int = setting(0, "classify: cap below the worker's own max batch (0: worker's)")
    prefetch_lead_ms: float = setting(3.0, "classify: a worker's next batch is formed this long before its running "
                                      "batch is expected to end, so late arrivals and other tenants get into it "
                                      "(a large value prefetches as soon as a slot is free)")
    max_queue_size: int = setting(1024, "per model: queued requests beyond which new ones are refused")
    max_num_batched_tokens: int = setting(0, "generate: token budget per step (0: worker's)")
    max_num_seqs: int = setting(0, "generate: running sequences per step (0: worker's)")
    long_prefill_chunk_tokens: int = setting(64, "generate: largest prompt chunk per step (chunked prefill); 0 disables chunking")
    max_long_partial_prefills: int = setting(1, "generate: prompts longer than one chunk that prefill at once; "
                                             "short prompts are admitted past the others (0: no limit)")
    fairness_preemption: bool = setting(True, "generate: a tenant below its weighted share of the running slots "
                                        "that waits preempts the newest sequence of a same-class tenant above its share")
    fairness_min_run_ms: float = setting(100.0, "generate: a sequence runs at least this long before fairness "
                                         "preemption may take its slot (anti-thrash)")
    fairness_share_credit: float = setting(200.0, "generate: service units (1 per prompt token, 2 per output "
                                           "token) by which a tenant below its share of the running slots "
                                           "counts as less served at admission (anti-churn)")
    pipelined_steps: bool = setting(True, "generate: send a worker its next step before the last one's result "
                                    "when every sequence in it decodes (on|off; workers that declare "
                                    "max_steps_in_flight >= 2 only, others get one step at a time)")
    steps_per_command: int = setting(
        4, "generate, pipelined: while no sequence waits for a slot, plan up to this many decode steps ahead and "
        "send them to the worker as one command, their results coming back together (fewer messages per token "
        "on both ends of the stream; tokens reach clients in bursts of up to this many). The first step after an "
        "idle spell and every step while sequences wait go alone. 1: one step per command; capped by what the "
        "worker declares (max_steps_per_command, half its max_steps_in_flight)")
    routing: str = setting("cache_aware", "generate: where a new sequence goes: least_loaded, random or cache_aware (prefix_routing.py)")
    orphan_grace_ms: float = setting(5000.0, "queued work of a model whose last worker left waits this long "
                                     "(at most until its deadline) for a worker to attach; held generate "
                                     "streams with a deadline wait until it")
    heartbeat_interval_ms: int = setting(1000, "how often workers send heartbeats")
    worker_timeout_ms: int = setting(5000, "a worker silent this long is treated as gone")
    deadline_margin_ms: float = setting(2.0, "time kept back from each request's deadline for the reply")
    prefix_cache: bool = setting(True, "generate: reuse the KV blocks of prompt prefixes a worker already computed "
                                 "(on|off); each tenant's blocks are its own, except inside public_prefixes")
    public_prefixes: str = setting("", "generate: prompt prefixes whose cached blocks every tenant shares (e.g. a "
                                   "common system prompt), as a JSON list of strings; empty: none")
    drain_grace_ms: float = setting(2000.0, "on SIGTERM, how long generate streams may run on before each still "
                                    "running is handed over (ended with UNAVAILABLE 'scheduler draining: stream "
                                    "handed over', pushback 0, for the gateway to resume elsewhere); at most "
                                    "0.8 x drain_grace_s")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.max_queue_delay_ms >= 0, f"max_queue_delay_ms must be >= 0, got {self.max_queue_delay_ms}")
        require(all(size >= 1 for size in self.preferred_batch_sizes),
                f"preferred_batch_sizes must all be >= 1, got {self.preferred_batch_sizes}")
        require(self.prefetch_lead_ms >= 0, f"prefetch_lead_ms must be >= 0, got {self.prefetch_lead_ms}")
        require(self.max_batch_size >= 0, f"max_batch_size must be >= 0, got {self.max_batch_size}")
        require(self.max_queue_size >= 1, f"max_queue_size must be >= 1, got {self.max_queue_size}")
        require(self.max_num_batched_tokens >= 0, f"max_num_batched_tokens must be >= 0, got {self.max_num_batched_tokens}")
        require(self.max_num_seqs >= 0, f"max_num_seqs must be >= 0, got {self.max_num_seqs}")
        require(self.long_prefill_chunk_tokens >= 0,
                f"long_prefill_chunk_tokens must be >= 0, got {self.long_prefill_chunk_tokens}")
        require(1 <= self.steps_per_command <= 64, f"steps_per_command must be in [1, 64], got {self.steps_per_command}")
        require(self.fairness_min_run_ms >= 0, f"fairness_min_run_ms must be >= 0, got {self.fairness_min_run_ms}")
        require(self.fairness_share_credit >= 0,
                f"fairness_share_credit must be >= 0, got {self.fairness_share_credit}")
        modes = [mode.value for mode in RoutingMode]
        require(self.routing in modes, f"routing must be {', '.join(modes[:-1])} or {modes[-1]}, got {self.routing!r}")
        require(self.orphan_grace_ms >= 0, f"orphan_grace_ms must be >= 0, got {self.orphan_grace_ms}")
        require(self.heartbeat_interval_ms >= 10, f"heartbeat_interval_ms must be >= 10, got {self.heartbeat_interval_ms}")
        require(self.worker_timeout_ms > self.heartbeat_interval_ms,
                "worker_timeout_ms must exceed heartbeat_interval_ms, got "
                f"{self.worker_timeout_ms} <= {self.heartbeat_interval_ms}")
        require(self.deadline_margin_ms >= 0, f"deadline_margin_ms must be >= 0, got {self.deadline_margin_ms}")
        require(self.drain_grace_ms >= 0, f"drain_grace_ms must be >= 0, got {self.drain_grace_ms}")
        self.public_prefix_texts()  # refuses a malformed list at startup

    def public_prefix_texts(self) -> tuple[str, ...]:
        """`public_prefixes` parsed: the texts an operator marked public."""
        if not self.public_prefixes.strip():
            return ()
        try:
            texts = json.loads(self.public_prefixes)
        except ValueError as exc:
            raise ConfigError(f"public_prefixes must be a JSON list of strings: {exc}") from None
        require(isinstance(texts, list) and all(isinstance(t, str) and t for t in texts),
                f"public_prefixes must be a JSON list of non-empty strings, got {self.public_prefixes!r}")
        return tuple(texts)
