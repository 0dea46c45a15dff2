"""bench_embeddings' pure parts: the prefill-only steps its in-process side runs, and what a closed loop's
requests say (throughput, quantiles, the load generator's own share). No timing, no I/O.

The in-process steps are those the scheduler's chunked prefill would plan for the same prompts, first
come first served: every step takes the waiting prompts in order, each as much of its rest as the
step's token budget has left, up to max_num_seqs prompts a step; a prompt the budget cuts continues at
the front of the next step. Embedding sequences never decode, so a prompt leaves the running set on the
step that ends it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from bench.harness.stats import quantile

# A run's generator fell behind when its own work (building bodies, reading and decoding replies,
# waiting for the GIL among its client threads) took more than this share of the median request.
LAG_SHARE_LIMIT = 0.05


@dataclass(frozen=True)
class Chunk:
    """Positions [start, end) of prompt `index`, computed in one step."""

    index: int
    start: int
    end: int


def prefill_steps(lengths: Sequence[int], budget: int, max_seqs: int) -> list[tuple[Chunk, ...]]:
    """The steps that compute every prompt of `lengths` (tokens each, in arrival order) under a token
    `budget` and `max_seqs` prompts a step. ValueError for an empty prompt or a budget below 1."""
    if budget < 1 or max_seqs < 1:
        raise ValueError(f"budget and max_seqs must be >= 1, got {budget} and {max_seqs}")
    if any(n < 1 for n in lengths):
        raise ValueError(f"every prompt needs a token, got lengths {list(lengths)}")
    done = [0] * len(lengths)
    steps: list[tuple[Chunk, ...]] = []
    first = 0  # the first prompt not yet ended
    while first < len(lengths):
        left, chunks = budget, list[Chunk]()
        for index in range(first, len(lengths)):
            if left == 0 or len(chunks) == max_seqs:
                break
            take = min(left, lengths[index] - done[index])
            chunks.append(Chunk(index, done[index], done[index] + take))
            done[index] += take
            left -= take
        steps.append(tuple(chunks))
        while first < len(lengths) and done[first] == lengths[first]:
            first += 1
    return steps


@dataclass(frozen=True)
class Sent:
    """One request of a closed loop, as its client saw it."""

    e2e_s: float  # from building the body to the decoded vectors
    client_s: float  # of it, the client's own work: the body, reading the reply off the socket's buffer, decoding
    num_inputs: int
    num_tokens: int  # the inputs' prompt tokens


@dataclass(frozen=True)
class Level:
    """One closed-loop run on one side: `clients` clients, each sending its requests in turn."""

    clients: int
    batch: int  # inputs per request
    wall_s: float
    sent: tuple[Sent, ...]
    load_average_1m: float  # the box's, as the run began
    generator_cpu_s: float  # the load generator process's CPU over the run (all its threads)
    # Each server process's CPU over the run (gateway, scheduler, worker; or the peer), seconds.
    server_cpu_s: tuple[tuple[str, float], ...] = ()

    @property
    def embeddings_per_s(self) -> float:
        return sum(s.num_inputs for s in self.sent) / self.wall_s

    @property
    def tokens_per_s(self) -> float:
        return sum(s.num_tokens for s in self.sent) / self.wall_s

    @property
    def tokens_per_server_cpu_s(self) -> float:
        """Prompt tokens per CPU second of the server's processes together: on a shared box, less
        dependent than tokens/s on the share of a core each process was given."""
        cpu_s = sum(c for _, c in self.server_cpu_s)
        return sum(s.num_tokens for s in self.sent) / cpu_s if cpu_s > 0 else math.nan

    @property
    def p50_s(self) -> float:
        return statistics.median(s.e2e_s for s in self.sent)

    @property
    def p99_s(self) -> float:
        return quantile((s.e2e_s for s in self.sent), 0.99)  # nearest rank: of a few requests, their largest

    @property
    def client_p99_s(self) -> float:
        return quantile((s.client_s for s in self.sent), 0.99)

    @property
    def fell_behind(self) -> bool:
        return self.client_p99_s > LAG_SHARE_LIMIT * self.p50_s

    def summary(self) -> dict[str, object]:
        return {"clients": self.clients, "batch": self.batch, "requests": len(self.sent),
                "embeddings_per_s": self.embeddings_per_s, "prompt_tokens_per_s": self.tokens_per_s,
                "e2e_p50_s": self.p50_s, "e2e_p99_s": self.p99_s, "wall_s": self.wall_s,
                "load_average_1m": self.load_average_1m,
                "generator": {"own_work_p99_s": self.client_p99_s, "cpu_share_of_one_core": self.generator_cpu_s / self.wall_s,
                              "fell_behind": self.fell_behind,
                              "limit": f"own work p99 <= {LAG_SHARE_LIMIT:g} x the median request"},
                "server_cpu_cores": {name: cpu_s / self.wall_s for name, cpu_s in self.server_cpu_s},
                "prompt_tokens_per_server_cpu_s": self.tokens_per_server_cpu_s,
                "e2e_s": [round(s.e2e_s, 4) for s in self.sent]}


def requests_each(clients: int, batch: int, inputs_in_all: int) -> int:
    """Each client's requests at a level: about `inputs_in_all` inputs over every client, at least one
    request each."""
    return max(1, -(-inputs_in_all // (clients * batch)))
