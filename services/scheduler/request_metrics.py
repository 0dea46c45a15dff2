"""Per-request metrics at the scheduler: requests_total by final status, end-to-end latency, with
bounded label values (services/common/metric_labels.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from services.common import errors
from services.common.clock import Clock
from services.common.metric_labels import FirstSeen, KnownValues
from services.common.status import status_code_of
from services.scheduler import metrics
from services.scheduler.call_codec import ANONYMOUS_TENANT

log = logging.getLogger(__name__)

# Distinct tenant ids that get their own series; the rest are counted as "_other".
MAX_TENANT_LABELS = 256


class Outcome:
    """The status code a request ended with, for requests_total."""

    code = "OK"


class RequestMetrics:
    def __init__(self, knows_model: Callable[[str], bool], clock: Clock) -> None:
        """`knows_model`: whether a worker ever attached a version of that name here."""
        self._clock = clock
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        # Models this scheduler has served, and the first tenant ids its gateways sent.
        self._model_label = KnownValues(knows_model)
        self._tenant_label = FirstSeen(MAX_TENANT_LABELS)

    @contextmanager
    def counted(self, model_name: str, tenant_id: str, kind: str, began_s: float) -> Iterator[Outcome]:
        """Counts the request by its final status (requests_total) and times successful classify replies."""
        outcome = Outcome()
        try:
            yield outcome
        except errors.InfermeshError as exc:
            outcome.code = status_code_of(exc).name
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome.code = "CANCELLED"
            raise
        except Exception:
            outcome.code = "INTERNAL"
            raise
        finally:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s %r finished: %s", kind, model_name, outcome.code)
            model_label = self._model_label(model_name)
            self._child(metrics.REQUESTS, model_label, self._tenant_label(tenant_id or ANONYMOUS_TENANT),
                        outcome.code).inc()
            if kind == "classify" and outcome.code == "OK":
                self._child(metrics.E2E_LATENCY, model_label, kind).observe(self._clock() - began_s)

    def generate_finished(self, model_name: str, latency_s: float) -> None:
        """A stream's last chunk went out (its model is a served one: it was admitted)."""
        self._child(metrics.E2E_LATENCY, model_name, "generate").observe(latency_s)

    def _child(self, metric: Any, *labels: str) -> Any:
        """metric.labels(*labels), remembered: the lookup takes a lock and is paid per request."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child
