"""Wiring: model runtime + Attach client + health, as one service for the bootstrap."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from services.common.admin_servicer import SERVICE_NAME as ADMIN_SERVICE
from services.common.admin_servicer import AdminServicer, add_to_server
from services.common.config import ConfigError
from services.common.scheduler_address import parse_scheduler_address
from services.common.server import Health, freeze_long_lived
from services.worker import admin_status, gpu_metrics, metrics
from services.worker.attach_client import AttachClient, Backoff
from services.worker.attach_every import EverySchedulerClient
from services.worker.builtin_models import TOY_MODELS
from services.worker.config import WorkerConfig
from services.worker.cpu_allocation import ThreadDecision, cgroup_levels, decide_num_threads, read_text
from services.worker.mock_models import MOCK_MODELS, make_mock_runtime
from services.worker.native_heap import trim_native_heap
from services.worker.repository.errors import ModelRepositoryError
from services.worker.runtime import BatchRuntime, StepRuntime, WorkerRuntime
from services.worker.scheduler_dialer import SchedulerDialer, resolve_dns
from services.worker.thread_settings import export_thread_env

log = logging.getLogger(__name__)


def make_runtime(config: WorkerConfig, num_threads: int) -> WorkerRuntime:
    if config.max_num_seqs and (config.model_name in MOCK_MODELS or config.model_name in TOY_MODELS):
        raise ConfigError(f"--max-num-seqs applies to repository generators, not {config.model_name} "
                          "(mock-generator takes max_num_seqs in --mock-profile)")
    if config.model_name in MOCK_MODELS:
        log.warning("%s serves mock tokens after a timer: for scale tests and benchmarks only", config.model_name)
        return make_mock_runtime(config.model_name, config.model_version, config.mock_profile,
                                 num_kv_blocks=config.num_kv_blocks, max_batch_size=config.max_batch_size)
    if config.model_name in TOY_MODELS:
        toy = TOY_MODELS[config.model_name]
        capacity = config.max_batch_size if config.model_name == "toy-classifier" else config.num_kv_blocks
        return toy(config.model_version, capacity, compute_ms=config.toy_compute_ms)
    from services.worker.model_runtime import load_repository_runtime

    return load_repository_runtime(config, num_threads)


def decide_threads(config: WorkerConfig) -> ThreadDecision:
    """The worker's thread count, exported to the environment before any compute library loads."""
    levels = cgroup_levels(read_text(Path("/proc/self/cgroup")))
    decision = decide_num_threads(config.num_threads, len(os.sched_getaffinity(0)), os.environ, levels)
    export_thread_env(decision.num_threads)
    log.info("compute threads: %d (source: %s; %s)", decision.num_threads, decision.source.value, decision.detail)
    return decision


class WorkerService:
    service_names: tuple[str, ...] = (ADMIN_SERVICE,)

    def __init__(self, config: WorkerConfig) -> None:
        self._config = config
        self.worker_id = config.worker_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._client: AttachClient | EverySchedulerClient | None = None
        self._task: asyncio.Task | None = None
        # Set by start(), read by Admin/GetStatus.
        self.threads: ThreadDecision | None = None
        self.runtime: WorkerRuntime | None = None

    def register(self, server) -> None:
        # Health and Admin only: the worker dials out for work.
        add_to_server(AdminServicer(*admin_status.handlers(self, self._config)), server)

    async def start(self, health: Health) -> None:
        threads = self.threads = decide_threads(self._config)
        metrics.THREADS.labels(self._config.model_name, threads.source.value).set(threads.num_threads)
        loop = asyncio.get_running_loop()
        model, version = self._config.model_name, self._config.model_version
        metrics.set_model_state(model, version, "loading")
        began_s = time.monotonic()
        try:
            runtime = await loop.run_in_executor(None, make_runtime, self._config, threads.num_threads)
            await loop.run_in_executor(None, runtime.load)
            # What loading freed (activations, the golden check's KV cache) leaves the RSS before serving.
            await loop.run_in_executor(None, trim_native_heap)
            freeze_long_lived()  # what is left (the model, torch's objects) lives as long as the process
        except ModelRepositoryError as exc:  # the version on disk cannot be served: exit 2, naming why
            raise ConfigError(f"model {model}:{version} cannot be served: {exc}") from None
        self.runtime = runtime
        metrics.MODEL_LOAD_SECONDS.labels(model, version).set(time.monotonic() - began_s)
        if gpu_metrics.register_if_cuda(model):
            log.info("CUDA device(s) found: exporting GPU device memory on /metrics")
        log.info("model %s:%s loaded and passed its golden check in %.1f s", model, version, time.monotonic() - began_s)
        self._client = self._attach_client(runtime)
        await health.set_serving(True)
        metrics.set_model_state(model, version, "ready")
        self._task = asyncio.create_task(self._client.run())

    def _attach_client(self, runtime: WorkerRuntime) -> AttachClient | EverySchedulerClient:
        """A classifier worker attaches to every scheduler (attach_every.py); a generator worker to one
        at a time, the one with fewest workers of its model (scheduler_dialer.py)."""
        config = self._config
        endpoints = parse_scheduler_address(config.scheduler_address)

        def backoff() -> Backoff:
            return Backoff(config.reconnect_initial_s, config.reconnect_max_s)

        if isinstance(runtime, BatchRuntime) and not isinstance(runtime, StepRuntime) and not endpoints.is_single:
            def new_client(address: str, compute: ThreadPoolExecutor) -> AttachClient:
                return AttachClient(address, runtime, self.worker_id, backoff(),
                                    keepalive_ms=config.attach_keepalive_ms, compute=compute)

            return EverySchedulerClient(endpoints, new_client, resolve_dns)
        dialer = SchedulerDialer(endpoints, runtime.hello(self.worker_id).model, self.worker_id)
        return AttachClient(dialer, runtime, self.worker_id, backoff(),
                            rebalance_interval_s=config.rebalance_interval_s, keepalive_ms=config.attach_keepalive_ms)

    async def drain(self, grace_s: float) -> None:
        metrics.set_model_state(self._config.model_name, self._config.model_version, "draining")
        if self._client is not None:
            await self._client.drain(grace_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._client is not None:
            self._client.close()
