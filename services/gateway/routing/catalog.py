"""What each scheduler's ListModels last said (kind, labels, input size of each attached model
version), looked up by model name: KServe's model metadata and readiness, the metric labels'
known models, and routing's "who serves this version" (`serving`). The pressure poller
(pressure_poller.py) fills it."""

from __future__ import annotations

from infermesh.v1 import gateway_pb2


class ModelCatalog:
    """What each endpoint's ListModels last said, looked up by model name."""

    def __init__(self) -> None:
        self._by_endpoint: dict[str, tuple[gateway_pb2.ModelInfo, ...]] = {}
        # Every model name some endpoint reported, kept on each update: `knows` runs per request.
        self._names: frozenset[str] = frozenset()
        # (name, version) -> endpoints that reported it ready; routing reads it per canary draw.
        self._ready: dict[tuple[str, str], frozenset[str]] = {}
        # (name, version) and (name, "") -> the largest max_seq_len reported; the quota hold reads it per Generate.
        self._max_seq_len: dict[tuple[str, str], int] = {}

    def update(self, endpoint: str, models: tuple[gateway_pb2.ModelInfo, ...]) -> None:
        self._by_endpoint[endpoint] = models
        self._reindex()

    def forget(self, endpoint: str) -> None:
        self._by_endpoint.pop(endpoint, None)
        self._reindex()

    def _reindex(self) -> None:
        self._names = frozenset(info.model.name for models in self._by_endpoint.values() for info in models)
        ready: dict[tuple[str, str], set[str]] = {}
        for endpoint, models in self._by_endpoint.items():
            for info in models:
                if info.ready:
                    ready.setdefault((info.model.name, info.model.version), set()).add(endpoint)
        self._ready = {key: frozenset(endpoints) for key, endpoints in ready.items()}
        max_seq_len: dict[tuple[str, str], int] = {}
        for models in self._by_endpoint.values():
            for info in models:
                for key in ((info.model.name, info.model.version), (info.model.name, "")):
                    max_seq_len[key] = max(max_seq_len.get(key, 0), info.max_seq_len)
        self._max_seq_len = max_seq_len

    def knows(self, name: str) -> bool:
        """Whether any endpoint reported a version of `name` (ready or not)."""
        return name in self._names

    def serving(self, name: str, version: str) -> frozenset[str]:
        """The endpoints whose last ListModels reported `version` of `name` ready."""
        return self._ready.get((name, version), frozenset())

    def knows_version(self, name: str, version: str) -> bool:
        """Whether any endpoint reported `version` of `name` (ready or not)."""
        return any(info.model.version == version for info in self.versions(name))

    def versions(self, name: str) -> list[gateway_pb2.ModelInfo]:
        """Every known version of `name` (one entry per version, ready if any endpoint is)."""
        by_version: dict[str, gateway_pb2.ModelInfo] = {}
        for models in self._by_endpoint.values():
            for info in models:
                if info.model.name != name:
                    continue
                known = by_version.get(info.model.version)
                if known is None or (info.ready and not known.ready):
                    by_version[info.model.version] = info
        return [by_version[v] for v in sorted(by_version)]

    def max_seq_len(self, name: str, version: str = "") -> int:
        """The most tokens (prompt + output) a sequence of `version` of `name` may hold, the largest
        any endpoint reported (of every version when version is ""); 0 when none reported it."""
        return self._max_seq_len.get((name, version), 0)

    def all_models(self) -> list[gateway_pb2.ModelInfo]:
        names = sorted({info.model.name for models in self._by_endpoint.values() for info in models})
        return [info for name in names for info in self.versions(name)]
