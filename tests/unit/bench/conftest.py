"""Builders the bench tests share."""

from __future__ import annotations

from bench.harness.send_result import SendResult


def make_send_result(scheduled_s: float = 0.0, latency_s: float = 0.01, status: str = "OK", lag_s: float = 0.0,
           leaf_stage_us: int = 0, tenant: str = "a", ttft_s: float | None = None, num_tokens: int = 0) -> SendResult:
    return SendResult(tenant, scheduled_s, scheduled_s + lag_s, scheduled_s + latency_s, status, leaf_stage_us,
                      ttft_s, num_tokens)
