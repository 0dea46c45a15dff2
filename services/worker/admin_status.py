"""The worker's Admin/GetStatus: the model it serves and what it has computed.

The worker's only listener serves health and this; it dials its scheduler for work.
`build_report` is pure; `collect` reads the WorkerService and the worker's own
Prometheus counters (metrics.py), so the figures equal what /metrics says.

Facts: tls, worker_id, model, version_served, state (loading | ready | draining), device, threads,
threads_source, scheduler_address, model_load_s.
Section `served` (one row: classify for a classifier, step for a generator): kind, num_batches, num_items_ok,
num_items_failed, num_items_expired, num_tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import REGISTRY

from services.common import admin, build_info
from services.worker.metrics import MODEL_STATES

_KINDS = (("classify", "classify"), ("step", "sequence_step"))  # (batch_size kind, items kind)
_STEPPED_KINDS = (2, 4)  # common_pb2.MODEL_KIND_GENERATOR, MODEL_KIND_EMBEDDING: served by steps


@dataclass(frozen=True)
class ServedView:
    kind: str
    num_batches: int
    num_items_ok: int
    num_items_failed: int
    num_items_expired: int
    num_tokens: int


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    model: str
    version: str
    state: str
    device: str
    threads: int  # 0 until decided at start
    threads_source: str
    scheduler_address: str
    model_load_s: float
    served: tuple[ServedView, ...]


def build_report(view: WorkerView, *, uptime_s: float, tls: str) -> admin.StatusReport:
    return admin.StatusReport(
        service="worker",
        version=build_info.VERSION,
        uptime_s=uptime_s,
        facts=admin.facts({
            "tls": tls, "worker_id": view.worker_id, "model": view.model, "version_served": view.version,
            "state": view.state, "device": view.device, "threads": view.threads,
            "threads_source": view.threads_source, "scheduler_address": view.scheduler_address,
            "model_load_s": round(view.model_load_s, 3),
        }),
        sections=(
            admin.section("served", ("kind", "num_batches", "num_items_ok", "num_items_failed", "num_items_expired",
                                     "num_tokens"), (
                (s.kind, s.num_batches, s.num_items_ok, s.num_items_failed, s.num_items_expired, s.num_tokens)
                for s in view.served
            )),
        ),
    )


# --------------------------------------------------------------------------- reading the live worker


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _state(model: str, version: str) -> str:
    return next((s for s in MODEL_STATES
                 if _sample("infermesh_worker_model_state", model=model, version=version, state=s) == 1), "loading")


def served(model: str, generator: bool) -> tuple[ServedView, ...]:
    """`model`: the counters' model label, "name:version" (attach_client.py)."""
    rows = []
    for kind, items_kind in _KINDS[1:] if generator else _KINDS[:1]:
        def items(outcome: str, items_kind=items_kind) -> int:
            return int(_sample("infermesh_worker_items_total", model=model, kind=items_kind, outcome=outcome))

        tokens = int(_sample("infermesh_worker_generated_tokens_total", model=model)) if kind == "step" else 0
        rows.append(ServedView(kind, int(_sample("infermesh_worker_batch_size_count", model=model, kind=kind)),
                               items("ok"), items("failed"), items("expired"), tokens))
    return tuple(rows)


def collect(service, config) -> WorkerView:
    """`service`: the WorkerService (server.py): its worker_id, and threads and runtime once started."""
    model, version = config.model_name, config.model_version
    threads, runtime = service.threads, service.runtime
    hello = runtime.hello(service.worker_id) if runtime is not None else None
    device = hello.capacity.device if hello is not None else ""
    generator = hello is not None and hello.kind in _STEPPED_KINDS
    return WorkerView(
        worker_id=service.worker_id, model=model, version=version, state=_state(model, version),
        device=device or "unknown", threads=threads.num_threads if threads else 0,
        threads_source=threads.source.value if threads else "", scheduler_address=config.scheduler_address,
        model_load_s=_sample("infermesh_worker_model_load_seconds", model=model, version=version),
        served=served(f"{model}:{version}", generator) if hello is not None else (),
    )


def handlers(service, config, clock=time.monotonic) -> tuple[admin.Authorize, admin.Report]:
    started_s = clock()
    tls = admin.tls_mode(config, client_certs_by_default=True)

    def report() -> admin.StatusReport:
        return build_report(collect(service, config), uptime_s=clock() - started_s, tls=tls)

    return admin.certificate_or_loopback, report
