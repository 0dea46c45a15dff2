"""GPU device memory on /metrics, read from torch at scrape time (names: deploy/observability/metrics.yaml).

Registered only where CUDA is available (the GPU overlay's workers). Utilisation, temperature,
power and ECC/Xid errors come from NVIDIA's DCGM exporter, which labels its series with the pod
using the GPU, so the dashboard joins both on the pod (docs/operations.md, "GPU workers").
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

LABELS = ["model", "device"]


class CudaMemory(Protocol):
    """What this collector reads of torch.cuda (tests pass a fake)."""

    def device_count(self) -> int: ...

    def memory_allocated(self, device: int) -> int: ...

    def memory_reserved(self, device: int) -> int: ...

    def mem_get_info(self, device: int) -> tuple[int, int]: ...


class GpuMemoryCollector(Collector):
    def __init__(self, cuda: CudaMemory, model: str) -> None:
        self._cuda = cuda
        self._model = model

    def collect(self) -> Iterator[GaugeMetricFamily]:
        allocated = GaugeMetricFamily(
            "infermesh_worker_gpu_memory_allocated_bytes",
            "Device memory held by this worker's live torch tensors", labels=LABELS)
        reserved = GaugeMetricFamily(
            "infermesh_worker_gpu_memory_reserved_bytes",
            "Device memory torch's caching allocator holds for this worker (allocated plus cached)", labels=LABELS)
        used = GaugeMetricFamily(
            "infermesh_worker_gpu_memory_used_bytes",
            "Device memory in use on the GPU by every process and allocator (total minus free; numba's too)",
            labels=LABELS)
        total = GaugeMetricFamily("infermesh_worker_gpu_memory_total_bytes", "The GPU's device memory",
                                  labels=LABELS)
        for device in range(self._cuda.device_count()):
            labels = [self._model, str(device)]
            free_bytes, total_bytes = self._cuda.mem_get_info(device)
            allocated.add_metric(labels, self._cuda.memory_allocated(device))
            reserved.add_metric(labels, self._cuda.memory_reserved(device))
            used.add_metric(labels, total_bytes - free_bytes)
            total.add_metric(labels, total_bytes)
        yield from (allocated, reserved, used, total)


def register_if_cuda(model: str, registry=None) -> bool:
    """Export GPU memory when this worker's model runs on torch and torch sees a CUDA device; False
    (nothing registered) otherwise. A runtime that never imported torch (toy and mock models) has no
    torch memory to report, and importing it here would add ~2 s of CPU to every such worker's start."""
    from prometheus_client import REGISTRY

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return False
    (registry or REGISTRY).register(GpuMemoryCollector(torch.cuda, model))
    return True
