"""Helpers for gateway tests against real processes: tenants files, extra gateways, metrics, statuses."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import yaml
from google.rpc import error_details_pb2, status_pb2
from prometheus_client.parser import text_string_to_metric_families

from infermesh.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.gateway.tenants.directory import hash_api_key
from tools.testbed import session_tls
from tools.testbed.processes import Mesh, ServiceProcess, free_port

BRIGHT = common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes([250] * 12), height=2, width=2, channels=3))
CLASSIFIER = common_pb2.ModelRef(name="toy-classifier")
GENERATOR = common_pb2.ModelRef(name="toy-generator")

GENEROUS = {"requests_per_s": 10_000, "requests_burst": 10_000, "tokens_per_s": 1e6, "tokens_burst": 1_000_000,
            "max_in_flight": 1000}


def tenant(tenant_id: str, api_key: str, priority: str = "standard", allowed_models="*", **quotas) -> dict:
    """One tenant entry for a tenants YAML; quotas default to generous."""
    return {
        "id": tenant_id,
        "api_key_sha256": [hash_api_key(api_key)],
        "priority": priority,
        "weight": 1,
        "allowed_models": allowed_models,
        "quotas": {**GENEROUS, **quotas},
    }


def write_tenants(path: Path, tenants: list[dict]) -> Path:
    path.write_text(yaml.safe_dump({"tenants": tenants}, sort_keys=False), encoding="utf-8")
    return path


def bearer(api_key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),)


def spawn_gateway(mesh: Mesh, name: str, *args: str, metrics_port: int | None = None) -> ServiceProcess:
    """Another gateway on the mesh's scheduler (Mesh.start_gateway keeps only one)."""
    extra = ["--metrics-port", str(metrics_port)] if metrics_port is not None else []
    process = ServiceProcess(
        name, "gateway", free_port(), ["--scheduler-address", mesh.scheduler.address, *extra, *args],
        dict(mesh.env), mesh.tmp / f"{name}.log", tls=mesh.tls,
    )
    mesh.processes.append(process)
    process.start()
    process.wait_serving()
    return process


def restart_on_same_port(mesh: Mesh, old: ServiceProcess, name: str) -> ServiceProcess:
    """A fresh process of the same service on the port `old` used (old must have exited).

    It takes the old one's place in the mesh, so the mesh still stops it after its workers
    (a scheduler stopped before them waits out its drain grace for their re-dials).
    """
    process = ServiceProcess(name, old.service, old.port, list(old.args), dict(old.env), mesh.tmp / f"{name}.log",
                             tls=old.tls)
    mesh.processes[mesh.processes.index(old)] = process
    if mesh.scheduler is old:
        mesh.scheduler = process
    process.start()
    process.wait_serving()
    return process


def scheduler_pressure(address: str, model_name: str) -> common_pb2.ModelPressure | None:
    """What the scheduler reports for `model_name` in GetPressure (None when it does not know it)."""
    with session_tls.channel(address) as channel:
        reply = scheduler_pb2_grpc.SchedulerStub(channel).GetPressure(scheduler_pb2.GetPressureRequest(), timeout=5)
    return next((m for m in reply.models if m.model.name == model_name), None)


# --------------------------------------------------------------------------- metrics


@dataclass(frozen=True)
class Metrics:
    samples: dict[tuple[str, frozenset], float]

    def value(self, name: str, **labels: str) -> float:
        """Sum of every sample of `name` whose labels include `labels` (0 when none)."""
        wanted = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and wanted <= ls)


def scrape(metrics_port: int) -> Metrics:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return Metrics(samples)


# --------------------------------------------------------------------------- statuses


@dataclass(frozen=True)
class Status:
    code: grpc.StatusCode
    message: str
    trailing: dict[str, str | bytes]

    @property
    def pushback_ms(self) -> int | None:
        value = self.trailing.get("grpc-retry-pushback-ms")
        return None if value is None else int(value)

    @property
    def retry_delay_s(self) -> float | None:
        """google.rpc.RetryInfo.retry_delay from the rich status details, None when absent."""
        raw = self.trailing.get("grpc-status-details-bin")
        if raw is None:
            return None
        rich = status_pb2.Status.FromString(raw)
        for detail in rich.details:
            info = error_details_pb2.RetryInfo()
            if detail.Unpack(info):
                return info.retry_delay.ToMilliseconds() / 1000
        return None


def status_of(call: Callable[[], object]) -> Status:
    """The error status `call` ends with (raises AssertionError if it succeeds)."""
    try:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, bytes | str):
            list(result)
    except grpc.RpcError as exc:
        return Status(exc.code(), exc.details(), dict(exc.trailing_metadata() or ()))
    raise AssertionError("the call succeeded; expected an error status")
