"""The scheduler's Admin/GetStatus: its models, their workers and queues.

`collect(registry)` reads the model registry into `ModelView`s of plain data; `build_report`
is pure (unit tests give it hand-made views).

Sections (columns are the JSON contract, docs/operations.md):
  models: model, version, kind, num_workers (usable), queue_depth, num_slots, kv_blocks_used,
          kv_blocks_total
  workers: worker_id, model, version, state (ready | draining | closed), num_in_flight (batches
           or steps sent, unanswered), num_sequences (generate: unfinished sequences it holds),
           slots (classify: max batch size; generate: max sequences per step), kv_blocks_used,
           kv_blocks_total (generate; 0 for classifiers)
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from services.common import admin, build_info
from services.scheduler.attach_types import ModelKind


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    state: str
    num_in_flight: int
    num_sequences: int
    slots: int
    kv_blocks_used: int
    kv_blocks_total: int


@dataclass(frozen=True)
class ModelView:
    model: str
    version: str
    kind: str
    queue_depth: int
    num_slots: int
    workers: tuple[WorkerView, ...]

    @property
    def num_usable_workers(self) -> int:
        return sum(w.state == "ready" for w in self.workers)


def build_report(models: Iterable[ModelView], *, uptime_s: float, draining: bool, tls: str) -> admin.StatusReport:
    models = sorted(models, key=lambda m: (m.model, m.version))
    return admin.StatusReport(
        service="scheduler",
        version=build_info.VERSION,
        uptime_s=uptime_s,
        facts=admin.facts({"tls": tls, "draining": draining}),
        sections=(
            admin.section("models", ("model", "version", "kind", "num_workers", "queue_depth", "num_slots",
                                     "kv_blocks_used", "kv_blocks_total"), (
                (m.model, m.version, m.kind, m.num_usable_workers, m.queue_depth, m.num_slots,
                 sum(w.kv_blocks_used for w in m.workers), sum(w.kv_blocks_total for w in m.workers))
                for m in models
            )),
            admin.section("workers", ("worker_id", "model", "version", "state", "num_in_flight", "num_sequences",
                                      "slots", "kv_blocks_used", "kv_blocks_total"), (
                (w.worker_id, m.model, m.version, w.state, w.num_in_flight, w.num_sequences, w.slots,
                 w.kv_blocks_used, w.kv_blocks_total)
                for m in models for w in sorted(m.workers, key=lambda w: w.worker_id)
            )),
        ),
    )


# --------------------------------------------------------------------------- reading the live scheduler


def _worker(link, pool, generator: bool) -> WorkerView:
    capacity = link.hello.capacity
    state = "closed" if link.closed.is_set() else "draining" if link.draining else "ready"
    return WorkerView(
        worker_id=link.worker_id,
        state=state,
        num_in_flight=link.num_in_flight,
        num_sequences=pool.num_sequences_on(link) if generator else 0,
        slots=(capacity.max_num_seqs if generator else capacity.max_batch_size),
        kv_blocks_used=link.kv_blocks_used if generator else 0,
        kv_blocks_total=capacity.num_kv_blocks if generator else 0,
    )


def collect(registry) -> list[ModelView]:
    """`registry`: the scheduler's ModelRegistry."""
    views = []
    for entry in registry.entries():
        kind = entry.kind.value
        generator = entry.kind is ModelKind.GENERATOR
        pool = entry.pool
        views.append(ModelView(
            model=entry.key.name, version=entry.key.version, kind=kind,
            queue_depth=pool.queue_depth, num_slots=pool.pressure().num_slots,
            workers=tuple(_worker(link, pool, generator) for link in pool.workers),
        ))
    return views


def handlers(service, config, clock=time.monotonic) -> tuple[admin.Authorize, admin.Report]:
    """The AdminServicer's callables for a SchedulerService (server.py): `service.servicer.registry`
    and `service.draining` are read on each call."""
    started_s = clock()
    tls = admin.tls_mode(config, client_certs_by_default=True)

    def report() -> admin.StatusReport:
        return build_report(collect(service.servicer.registry), uptime_s=clock() - started_s,
                            draining=service.draining, tls=tls)

    return admin.certificate_or_loopback, report
