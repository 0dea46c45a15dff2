"""Which scheduler endpoints the gateway polls every RECOVERY_POLL_S instead of on its schedule.

An endpoint is watched while it is on its way back: from the first time this gateway sees it, and
again from any failed poll. It stays watched for as long as it does not answer, and once it
answers, until it is back in full, for at most RECOVERY_WATCH_S from its first answer:

* it reports ready every model it had ever reported ready to this gateway when it went away; or
* when it never reported one (it is new here), its ready models are not none and have stayed the
  same for RECOVERY_SETTLE_S.

Why not "until any model is ready": a restarted scheduler lists a model only once a worker of it
attached, and the models come back one by one. A classifier worker is attached to every scheduler
and re-dials within its backoff; a generator worker is attached to one at a time, so the restarted
scheduler's comes seconds later, when a killed one returns or one moves over. Stopping at the
first model left the gateway to learn of the generator at its next whole-second poll (2.7-3.2 s
after the classifier in `make chaos`). A model that never returns (its workers all went to another
scheduler) costs RECOVERY_WATCH_S of fast polls: two cheap RPCs every RECOVERY_POLL_S.

Keeps what it learnt of each endpoint for this gateway's life: one entry per endpoint ever seen.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from services.common.clock import Clock

RECOVERY_POLL_S = 0.1
RECOVERY_WATCH_S = 10.0
RECOVERY_SETTLE_S = 1.0


@dataclass
class _Return:
    """One endpoint on its way back."""

    # Polled fast until then: inf while it does not answer, its first answer + RECOVERY_WATCH_S after.
    until_s: float
    # Every model it had reported ready when it went away (none when it is new here).
    served_before: frozenset[str]
    # Its last poll's ready models, and since when they have been these.
    ready: frozenset[str] = frozenset()
    ready_since_s: float = -math.inf


class RecoveryWatch:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._returning: dict[str, _Return] = {}
        # endpoint -> every model it reported ready to this gateway (what "back in full" means).
        self._ever_ready: dict[str, frozenset[str]] = {}
        self._seen: set[str] = set()

    def watched(self, endpoints: Iterable[str]) -> tuple[str, ...]:
        """Those of `endpoints` to poll every RECOVERY_POLL_S now."""
        now_s = self._clock()
        watched = []
        for endpoint in endpoints:
            returning = self._returning_of(endpoint, now_s)
            if returning is None:
                continue
            if returning.until_s > now_s:
                watched.append(endpoint)
            else:
                del self._returning[endpoint]
        return tuple(watched)

    def failed(self, endpoint: str) -> None:
        """A poll of `endpoint` got no answer: watched until it answers, then as on its return."""
        self._seen.add(endpoint)
        self._returning[endpoint] = _Return(until_s=math.inf,
                                            served_before=self._ever_ready.get(endpoint, frozenset()))

    def answered(self, endpoint: str, ready_models: Iterable[str]) -> None:
        """A poll of `endpoint` answered, with these models ready."""
        now_s = self._clock()
        ready = frozenset(ready_models)
        returning = self._returning_of(endpoint, now_s)
        self._ever_ready[endpoint] = self._ever_ready.get(endpoint, frozenset()) | ready
        if returning is None:
            return
        if returning.until_s == math.inf:
            returning.until_s = now_s + RECOVERY_WATCH_S
        if ready != returning.ready:
            returning.ready, returning.ready_since_s = ready, now_s
        if _back_in_full(returning, now_s):
            del self._returning[endpoint]

    def _returning_of(self, endpoint: str, now_s: float) -> _Return | None:
        if endpoint not in self._seen:
            self._seen.add(endpoint)
            self._returning[endpoint] = _Return(until_s=now_s + RECOVERY_WATCH_S, served_before=frozenset())
        return self._returning.get(endpoint)


def _back_in_full(returning: _Return, now_s: float) -> bool:
    if not returning.ready:
        return False
    if returning.served_before:
        return returning.ready >= returning.served_before
    return now_s - returning.ready_since_s >= RECOVERY_SETTLE_S
