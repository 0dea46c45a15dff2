"""Gateway configuration (flags / INFERMESH_GATEWAY_* variables)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import ServerSettings, require, setting


@dataclass(frozen=True)
class GatewayConfig(ServerSettings):
    scheduler_address: str = setting("127.0.0.1:50052", "default scheduler host:port for every model")
    default_deadline_ms: float = setting(30_000.0, "deadline applied when the client sets none")
    max_deadline_ms: float = setting(300_000.0, "client deadlines are clamped to this")
    hop_margin_ms: float = setting(5.0, "time kept back from the deadline passed to the scheduler")
    tenants_file: str = setting("", "tenant/API-key YAML; empty admits every caller as tenant 'anonymous'")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(":" in self.scheduler_address, f"scheduler_address must be host:port, got {self.scheduler_address!r}")
        require(self.default_deadline_ms > 0, f"default_deadline_ms must be > 0, got {self.default_deadline_ms}")
        require(
            self.max_deadline_ms >= self.default_deadline_ms,
            f"max_deadline_ms ({self.max_deadline_ms}) must be >= default_deadline_ms ({self.default_deadline_ms})",
        )
        require(self.hop_margin_ms >= 0, f"hop_margin_ms must be >= 0, got {self.hop_margin_ms}")
