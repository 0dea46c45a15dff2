"""GPU device memory on /metrics: what the collector exports is exactly the contract's gpu_only metrics."""

from __future__ import annotations

import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.worker.gpu_metrics import GpuMemoryCollector, register_if_cuda
from tools.testbed.processes import ROOT

GIB = 1 << 30


class FakeCuda:
    """Two devices: 1 GiB in tensors, 2 GiB reserved, 3 GiB used of 80 on each."""

    def device_count(self) -> int:
        return 2

    def memory_allocated(self, device: int) -> int:
        return 1 * GIB + device

    def memory_reserved(self, device: int) -> int:
        return 2 * GIB

    def mem_get_info(self, device: int) -> tuple[int, int]:
        return 77 * GIB, 80 * GIB


def _exported(cuda) -> dict[str, list]:
    registry = CollectorRegistry()
    registry.register(GpuMemoryCollector(cuda, "digits"))
    text = generate_latest(registry).decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def test_every_gpu_only_contract_metric_is_exported_per_device_with_its_labels():
    contract = {m["name"]: m for m in yaml.safe_load((ROOT / "deploy/observability/metrics.yaml").read_text())["metrics"]
                if m.get("gpu_only")}
    exported = _exported(FakeCuda())
    assert set(exported) == set(contract)
    for name, samples in exported.items():
        assert contract[name]["type"] == "gauge"
        assert [s.labels for s in samples] == [{"model": "digits", "device": "0"}, {"model": "digits", "device": "1"}]
        assert set(contract[name]["labels"]) == set(samples[0].labels)


def test_values_are_torchs_figures_at_scrape_time():
    exported = _exported(FakeCuda())
    value = {name: samples[1].value for name, samples in exported.items()}  # device 1
    assert value["infermesh_worker_gpu_memory_allocated_bytes"] == GIB + 1
    assert value["infermesh_worker_gpu_memory_reserved_bytes"] == 2 * GIB
    assert value["infermesh_worker_gpu_memory_used_bytes"] == 3 * GIB
    assert value["infermesh_worker_gpu_memory_total_bytes"] == 80 * GIB


def test_a_cpu_worker_registers_nothing():
    import torch  # noqa: F401 - a model runtime on torch, as digits and tinylm are

    registry = CollectorRegistry()
    assert register_if_cuda("digits", registry) is False  # this machine has no GPU
    assert generate_latest(registry) == b""


def test_a_worker_without_torch_neither_imports_it_nor_registers(monkeypatch):
    """Toy and mock workers never import torch: importing it to look for a GPU cost ~2 s per start."""
    import sys

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    registry = CollectorRegistry()
    assert register_if_cuda("toy-classifier", registry) is False
    assert "torch" not in sys.modules
