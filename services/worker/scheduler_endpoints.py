"""Which scheduler a worker attaches to, when `--scheduler-address` names several.

The flag is `host:port[,host:port...]` or `dns:///name:port` (every A/AAAA record of
`name` is an endpoint, resolved again at every re-dial: a Kubernetes headless
Service), parsed by services/common/scheduler_address.py as the gateway parses it. A classifier
worker attaches to all of them (attach_every.py). A generator worker attaches to one scheduler at a
time (the scheduler owns its KV block tables). To spread a model's workers
over the schedulers it asks each endpoint how many workers of its model it has
(GetPressure's num_workers) and dials them fewest first; ties are broken by a hash
of (worker_id, endpoint), so workers that see the same counts still prefer
different schedulers (rendezvous hashing). The endpoint it just left (its stream
broke, or the scheduler drained) goes last, so it re-dials another one at once.
Endpoints that did not answer are not dialled this round.

Rebalancing: counts drift (a restarted scheduler has no workers; after a rolling
restart every worker may sit on the scheduler rolled last), so an attached worker
looks again now and then and moves, gracefully, when its scheduler has two or more
workers of its model more than another (`move_probability`). While another scheduler is
missing or a move is due (`is_unsettled`) it looks every few hundred ms (capped backoff with
jitter) instead.

A scheduler with no worker of our model serves none of its streams, so filling it does not wait
for a graceful move (which lets the worker's running streams finish first: as long as the
longest of them: a restarted scheduler's first generate came 2.3 s after its SERVING with
3 s streams running, issue 35): `EmptySchedulerMove` moves a worker at once, its sequences
resumed on its scheduler's other workers. Only from a scheduler with two or more workers of the model to one with
none, so a move never empties the scheduler it leaves and never reverses itself (after it the
two have one or more each, and nothing more moves); confirmed by a second look after a random
0.05-0.4 s, so the workers of one scheduler, all seeing the same empty one, do not all go: the
first to move is no longer counted there when the others look again (and a last look right
before leaving, so that the window in which two could both go is about one probe).

Pure logic: no grpc; the resolver and the probe are injected.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from services.common.scheduler_address import SchedulerAddress


@dataclass(frozen=True)
class EndpointLoad:
    """What one endpoint answered: its workers of our model (None: it did not answer)."""

    address: str
    num_workers: int | None


Resolver = Callable[[str, int], Awaitable[Sequence[str]]]  # (name, port) -> IP addresses


async def resolve(endpoints: SchedulerAddress, resolver: Resolver) -> list[str]:
    """The endpoints' `host:port` addresses now (DNS: one per distinct record, IPv6 in brackets)."""
    if not endpoints.is_dns:
        return list(endpoints.endpoints)
    ips = await resolver(endpoints.dns_name, endpoints.port)
    return [f"[{ip}]:{endpoints.port}" if ":" in ip else f"{ip}:{endpoints.port}"
            for ip in dict.fromkeys(ips)]


def dial_order(loads: Sequence[EndpointLoad], worker_id: str, avoid: str | None = None) -> list[str]:
    """Endpoints to try, best first: those that answered, the one to avoid last, then fewest workers
    of our model, then the rendezvous hash of (worker_id, address)."""
    answered = [load for load in loads if load.num_workers is not None]
    answered.sort(key=lambda load: (load.address == avoid, load.num_workers, _tie_break(worker_id, load.address)))
    return [load.address for load in answered]


def move_probability(loads: Sequence[EndpointLoad], current: str) -> float:
    """Rebalancing: the chance that this worker, attached to `current`, should move now.

    Only when `current` has at least two workers of our model more than the emptiest other
    scheduler (one move then narrows the gap without reversing it). Every worker of `current`
    decides alone, each with gap / (2 x its count), so about gap / 2 of them move: the counts
    meet in the middle on average, without any worker knowing the others.
    """
    mine = next((load.num_workers for load in loads if load.address == current), None)
    others = [load.num_workers for load in loads if load.address != current and load.num_workers is not None]
    if not mine or not others:
        return 0.0
    gap = mine - min(others)
    return gap / (2 * mine) if gap >= 2 else 0.0


def empty_target(loads: Sequence[EndpointLoad], current: str, worker_id: str) -> str | None:
    """A scheduler that answered with no worker of our model, when `current` answered with two or
    more (else None); of several, the first by the rendezvous hash of (worker_id, address)."""
    mine = next((load.num_workers for load in loads if load.address == current), None)
    if mine is None or mine < 2:
        return None
    empty = [load.address for load in loads if load.address != current and load.num_workers == 0]
    return min(empty, key=lambda address: _tie_break(worker_id, address), default=None)


# The second look before moving to an empty scheduler comes this long after the first (uniform).
CONFIRM_MIN_S = 0.05
CONFIRM_MAX_S = 0.4


@dataclass(frozen=True)
class MoveNow:
    """Leave the current scheduler for `target` now."""

    target: str


@dataclass(frozen=True)
class LookAgain:
    """An empty scheduler was seen: look again in `delay_s` to confirm it before moving."""

    delay_s: float


class EmptySchedulerMove:
    """The move to a scheduler with no worker of our model (see the module's docstring): `look` at
    each probe's loads says MoveNow, LookAgain, or None (nothing empty to fill: the graceful
    rebalancing decides). Pure: the clock and the random draws are injected."""

    def __init__(self, worker_id: str, clock: Callable[[], float], rng: random.Random) -> None:
        self._worker_id = worker_id
        self._clock = clock
        self._rng = rng
        self._due_s: float | None = None  # when the confirming look is due (an empty scheduler seen)

    def look(self, loads: Sequence[EndpointLoad], current: str) -> MoveNow | LookAgain | None:
        target = empty_target(loads, current, self._worker_id)
        now_s = self._clock()
        if target is None:
            self._due_s = None
            return None
        if self._due_s is None:
            delay_s = self._rng.uniform(CONFIRM_MIN_S, CONFIRM_MAX_S)
            self._due_s = now_s + delay_s
            return LookAgain(delay_s)
        if now_s < self._due_s:
            return LookAgain(self._due_s - now_s)
        self._due_s = None
        return MoveNow(target)

    def reset(self) -> None:
        """A new session: whatever was seen from the last one is stale."""
        self._due_s = None


def is_unsettled(loads: Sequence[EndpointLoad], current: str) -> bool:
    """Whether to look again soon rather than at the rebalance interval: another scheduler did not
    answer (lost, or not started yet: when it comes back it has no workers and serves nothing until
    one attaches) or a move is due now (`move_probability` > 0)."""
    others_silent = any(load.num_workers is None for load in loads if load.address != current)
    return others_silent or move_probability(loads, current) > 0


def _tie_break(worker_id: str, address: str) -> bytes:
    return hashlib.blake2b(f"{worker_id}|{address}".encode(), digest_size=8).digest()
