"""The HTTP status and Retry-After of a domain error: one table for both HTTP fronts (OpenAI /v1,
KServe REST /v2), which differ only in the body they put around it. No aiohttp here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from services.common import errors
from services.gateway.admission.latency_admission import ObjectiveMissed, ObjectiveUnmeetable
from services.gateway.quota.quotas import QuotaExceeded

# The first class in the error's MRO wins.
_STATUS: dict[type, int] = {
    QuotaExceeded: 429,
    # Latency objectives (docs/gateway.md): predicted to miss the TTFT target everywhere, or never meetable.
    ObjectiveMissed: 429,
    ObjectiveUnmeetable: 400,
    errors.InvalidArgument: 400,
    errors.Unauthenticated: 401,
    errors.PermissionDenied: 403,
    errors.NotFound: 404,
    # Shed, over a concurrency limit or a scheduler's queue full: overload, not the tenant's quota.
    errors.ResourceExhausted: 503,
    errors.Unavailable: 503,
    errors.DeadlineExceeded: 504,
    errors.Cancelled: 499,
    errors.Internal: 500,
}


@dataclass(frozen=True)
class HttpRefusal:
    status: int
    # Retry-After, whole seconds; None when the error carries no hint.
    retry_after_s: int | None

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


def matching(table: Mapping[type, object], err: errors.InfermeshError) -> type:
    """The class of `err` (or its nearest base) that `table` has a row for; errors.Internal if none."""
    return next((c for c in type(err).__mro__ if c in table), errors.Internal)


def http_refusal(err: errors.InfermeshError) -> HttpRefusal:
    retry_after_s = getattr(err, "retry_after_s", None)
    return HttpRefusal(_STATUS[matching(_STATUS, err)],
                       None if retry_after_s is None else max(1, math.ceil(retry_after_s)))
