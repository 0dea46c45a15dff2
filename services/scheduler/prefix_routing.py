"""Which worker a new generate sequence goes to: least loaded, random, or cache-aware.

The scheduler owns every worker's block tables, so it knows exactly how many leading blocks
of a prompt each worker still holds (`KVBlockManager.num_cached_prefix_blocks`); no event bus,
no guess. Cache-aware routing turns that into a cost per worker and takes the cheapest:

    cost = prefill_weight x (uncached prompt tokens + prefill tokens queued on the worker)
         + sequence_weight x (sequences on the worker)
         + over_capacity_weight x (sequences beyond its max_num_seqs, the newcomer included)

The unit is "tokens the worker computes before the newcomer's first token". A step's time grows
with the tokens it carries (prefill-bound: a CPU worker always, a GPU one for prompts), so:

* the newcomer's own uncached prompt tokens, and the prompt tokens still to compute of the
  sequences routed there before it (waiting, or part-way through their prompt; less what they
  will find cached), are the prefill ahead of its first token: weight 1 per token;
* every sequence there decodes one token per step for the steps that prefill spans, and takes a
  running slot: a flat `sequence_weight` tokens each (Dynamo's decode-load term, in tokens);
* a worker whose running slots are all taken makes the newcomer wait for a running sequence to
  end (many decode steps, unknown in advance): `over_capacity_weight` per sequence beyond the
  slots. This is the overload valve: a worker holding a tenant's prefix stops attracting that
  tenant once its queue costs more than the prefix saves (a 500-token prefix saves 500; with
  the defaults about 15 more sequences, or 3 beyond its slots, outweigh it).

Dynamo scores `w x prefill blocks + decode blocks`; this is the same form with the prefill queue
counted (a worker with a backlog of prompts is slow to a first token whatever it caches) and the
slot limit of continuous batching made explicit.

Ties (equal cost within `TIE_EPSILON`): more cached tokens, then fewer sequences, then lower KV
usage, then the caller's order. `least_loaded` keeps the scheduler's original rule (fewest
sequences, then lowest KV usage); `random` picks uniformly, as a baseline for the benchmark.

Cached counts come from blocks resident in the scheduler's tables. A burst of one prefix arrives
before any of it is computed, so `RecentPrefixes` also remembers, for `ttl_s`, which worker each
recently routed prompt's blocks went to: the burst follows its first request instead of being
prefilled on every worker at once.
"""

from __future__ import annotations

import enum
import random
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from services.common.clock import Clock

W = TypeVar("W", bound=Hashable)

TIE_EPSILON = 1e-9


class RoutingMode(enum.Enum):
    LEAST_LOADED = "least_loaded"
    RANDOM = "random"
    CACHE_AWARE = "cache_aware"


@dataclass(frozen=True)
class WorkerLoad:
    """What the scheduler knows of one worker's work now."""

    num_running: int
    num_waiting: int  # never scheduled, or preempted (holding no blocks)
    max_num_seqs: int  # running slots
    num_prefill_tokens: int  # tokens still to compute of prompts (and recomputes) there
    kv_usage: float  # fraction of KV blocks held, [0, 1]

    @property
    def num_unfinished(self) -> int:
        return self.num_running + self.num_waiting


@dataclass(frozen=True)
class Candidate(Generic[W]):
    worker: W
    num_cached_tokens: int  # leading prompt tokens whose KV the worker holds (whole blocks)
    load: WorkerLoad


@dataclass(frozen=True)
class RoutingWeights:
    prefill_weight: float = 1.0  # per prompt token to compute (the newcomer's and those queued)
    sequence_weight: float = 32.0  # token-equivalents per sequence on the worker
    over_capacity_weight: float = 160.0  # token-equivalents per sequence beyond the running slots

    def __post_init__(self) -> None:
        for name in ("prefill_weight", "sequence_weight", "over_capacity_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


def routing_cost(num_prompt_tokens: int, candidate: Candidate[W], weights: RoutingWeights) -> float:
    """The module docstring's cost; at least one prompt token is always computed (the one sampled from)."""
    load = candidate.load
    uncached = max(1, num_prompt_tokens - candidate.num_cached_tokens)
    num_after = load.num_unfinished + 1
    over_capacity = max(0, num_after - load.max_num_seqs) if load.max_num_seqs > 0 else 0
    return (weights.prefill_weight * (uncached + load.num_prefill_tokens)
            + weights.sequence_weight * load.num_unfinished
            + weights.over_capacity_weight * over_capacity)


def choose_worker(mode: RoutingMode, num_prompt_tokens: int, candidates: Sequence[Candidate[W]],
                  rng: random.Random, weights: RoutingWeights = RoutingWeights()) -> W:
    """The worker a new sequence of `num_prompt_tokens` goes to; `candidates` is non-empty."""
    if not candidates:
        raise ValueError("no candidate workers")
    if mode is RoutingMode.RANDOM:
        return rng.choice(candidates).worker
    if mode is RoutingMode.LEAST_LOADED:
        return min(candidates, key=lambda c: (c.load.num_unfinished, c.load.kv_usage)).worker
    costs = [routing_cost(num_prompt_tokens, c, weights) for c in candidates]
    lowest = min(costs)
    tied = [c for c, cost in zip(candidates, costs, strict=True) if cost - lowest <= TIE_EPSILON]
    return min(tied, key=lambda c: (-c.num_cached_tokens, c.load.num_unfinished, c.load.kv_usage)).worker


class RecentPrefixes(Generic[W]):
    """Which worker recently routed prompts' blocks went to, for `ttl_s` of `clock`: blocks a
    worker is about to compute count as cached there, so the requests of one prefix that arrive
    together go together."""

    def __init__(self, clock: Clock, ttl_s: float = 2.0, max_entries: int = 65536) -> None:
        if ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0, got {ttl_s}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self._clock = clock
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._expires_s: dict[tuple[W, int], float] = {}
        self._order: deque[tuple[float, W, int]] = deque()  # by expiry: the oldest first

    def __len__(self) -> int:
        return len(self._expires_s)

    def record(self, worker: W, block_hashes: Sequence[int]) -> None:
        """`block_hashes` (a prompt's, chained, one per full block) are being computed on `worker`."""
        self._prune()
        expires_s = self._clock() + self._ttl_s
        for block_hash in block_hashes:
            self._expires_s[(worker, block_hash)] = expires_s
            self._order.append((expires_s, worker, block_hash))
        while len(self._order) > self._max_entries:
            self._forget(*self._order.popleft())

    def num_leading(self, worker: W, block_hashes: Sequence[int]) -> int:
        """How many of the leading `block_hashes` were recently routed to `worker`."""
        now = self._clock()
        num = 0
        for block_hash in block_hashes:
            expires_s = self._expires_s.get((worker, block_hash))
            if expires_s is None or expires_s <= now:
                break
            num += 1
        return num

    def forget_worker(self, worker: W) -> None:
        """The worker left: nothing routed there is about to be computed any more."""
        for key in [key for key in self._expires_s if key[0] == worker]:
            del self._expires_s[key]

    def _prune(self) -> None:
        now = self._clock()
        while self._order and self._order[0][0] <= now:
            self._forget(*self._order.popleft())

    def _forget(self, expires_s: float, worker: W, block_hash: int) -> None:
        # A hash recorded again later has a later expiry: only the entry's last record removes it.
        if self._expires_s.get((worker, block_hash)) == expires_s:
            del self._expires_s[(worker, block_hash)]


class PrefixIndex(Protocol):
    """One worker's resident blocks as the scheduler's KVBlockManager knows them."""

    @property
    def block_size(self) -> int: ...

    def num_cached_prefix_blocks(self, hashes: Sequence[int], /) -> int: ...


# (token ids, block size, tenant id, LoRA adapter or "") -> one chained hash per full block, as the prefix
# cache names them.
BlockHasher = Callable[[Sequence[int], int, str, str], list[int]]


@dataclass(frozen=True)
class Route(Generic[W]):
    worker: W
    # Leading tokens counted as cached there when it was chosen: the pool's estimate of this
    # sequence's prefill while it waits (the step scheduler looks the cache up only at admission).
    num_cached_tokens: int
    # The prompt's full-block hashes at the worker's block size (the block of its last token
    # excluded), for the step scheduler to keep instead of hashing again; () when not hashed.
    block_hashes: Sequence[int] = field(default=(), compare=False)


@dataclass(frozen=True)
class WorkerView(Generic[W]):
    worker: W
    load: WorkerLoad
    index: PrefixIndex | None  # None: this worker keeps no prefix cache


class Router(Generic[W]):
    """Routes new sequences by `mode`: hashes the prompt once per block size, asks each worker's
    index how much of it is resident (or was just routed there), and picks by choose_worker()."""

    def __init__(self, mode: RoutingMode, clock: Clock, hash_blocks: BlockHasher | None, *,
                 rng: random.Random | None = None, weights: RoutingWeights = RoutingWeights(),
                 recent_ttl_s: float = 2.0) -> None:
        """`hash_blocks` None: the prefix cache is off, so nothing is ever cached."""
        self.mode = mode
        self._hash_blocks = hash_blocks
        self._rng = rng or random.Random()
        self._weights = weights
        self._recent: RecentPrefixes[W] = RecentPrefixes(clock, recent_ttl_s)

    def choose(self, token_ids: Sequence[int], tenant_id: str, workers: Sequence[WorkerView[W]],
               lora_adapter: str = "") -> Route[W]:
        if not workers:
            raise ValueError("no candidate workers")
        if self.mode is not RoutingMode.CACHE_AWARE or self._hash_blocks is None:
            candidates = [Candidate(w.worker, 0, w.load) for w in workers]
            return Route(choose_worker(self.mode, len(token_ids), candidates, self._rng, self._weights), 0)
        hashes_by_size: dict[int, list[int]] = {}
        # The block of the last token is never reused (a step computes it to sample): not hashed.
        head = token_ids[:len(token_ids) - 1]
        candidates = []
        for view in workers:
            num_cached = 0
            if view.index is not None:
                size = view.index.block_size
                if size not in hashes_by_size:
                    hashes_by_size[size] = self._hash_blocks(head, size, tenant_id, lora_adapter)
                hashes = hashes_by_size[size]
                num_blocks = max(view.index.num_cached_prefix_blocks(hashes),
                                 self._recent.num_leading(view.worker, hashes))
                num_cached = num_blocks * size
            candidates.append(Candidate(view.worker, num_cached, view.load))
        chosen = choose_worker(self.mode, len(token_ids), candidates, self._rng, self._weights)
        view, candidate = next((v, c) for v, c in zip(workers, candidates, strict=True) if v.worker == chosen)
        if view.index is None:
            return Route(chosen, candidate.num_cached_tokens)
        hashes = hashes_by_size[view.index.block_size]
        self._recent.record(chosen, hashes)
        return Route(chosen, candidate.num_cached_tokens, hashes)

    def forget_worker(self, worker: W) -> None:
        self._recent.forget_worker(worker)
