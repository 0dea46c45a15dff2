"""The token fast path benchmark's requests: the issue's workload as pure data, no grpc.

Open-loop Poisson arrivals of greedy Generate requests with EOS ignored, prompts of 8-48 bytes
and `max_tokens` uniform in [8, 128]. The mesh's load processes and the in-process baseline
replay the same list (same seed: same arrival times, prompts and lengths), so their latencies
compare request for request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bench.harness.load_plan import poisson_times_s

MIN_PROMPT_BYTES = 8
MAX_PROMPT_BYTES = 48
MIN_MAX_TOKENS = 8
MAX_MAX_TOKENS = 128
# ASCII only, so a prompt's bytes are its characters and its byte tokens.
CORPUS = (
    "The quick brown fox jumps over the lazy dog while the scheduler batches requests. "
    "A list is not the same as a tuple, and a string is a sequence of characters. "
    "Every worker dials the scheduler and runs the steps it is given, one after another. "
    "Return the value of the named attribute of object; name must be a string. "
)


@dataclass(frozen=True)
class TokenRequest:
    scheduled_s: float  # seconds after the run's start
    prompt: str  # ASCII, MIN_PROMPT_BYTES..MAX_PROMPT_BYTES bytes
    max_tokens: int  # generated tokens (EOS ignored, so exactly this many)


def make_requests(rate_per_s: float, duration_s: float, seed: int) -> tuple[TokenRequest, ...]:
    """Poisson arrivals at `rate_per_s` over `duration_s`, each with a drawn prompt and length."""
    rng = np.random.default_rng(seed)
    times_s = poisson_times_s(rate_per_s, duration_s, rng)
    return tuple(TokenRequest(float(t), *draw_prompt_and_length(rng)) for t in times_s)


def closed_loop_requests(num_requests: int, seed: int) -> tuple[TokenRequest, ...]:
    """`num_requests` drawn the same way, all due at 0 (closed-loop clients cycle through them)."""
    rng = np.random.default_rng(seed)
    return tuple(TokenRequest(0.0, *draw_prompt_and_length(rng)) for _ in range(num_requests))


def draw_prompt_and_length(rng: np.random.Generator) -> tuple[str, int]:
    num_bytes = int(rng.integers(MIN_PROMPT_BYTES, MAX_PROMPT_BYTES + 1))
    start = int(rng.integers(0, len(CORPUS) - num_bytes + 1))
    return CORPUS[start:start + num_bytes], int(rng.integers(MIN_MAX_TOKENS, MAX_MAX_TOKENS + 1))


@dataclass(frozen=True)
class LoadPhase:
    """One load the mesh and the baseline both get: open loop at `rate_per_s`, or closed loop
    with `concurrency` clients (rate_per_s 0) cycling through NUM_CLOSED_LOOP_REQUESTS requests."""

    name: str  # e.g. "5/s", "closed 48"
    duration_s: float
    seed: int
    rate_per_s: float = 0.0
    concurrency: int = 0

    def __post_init__(self) -> None:
        if (self.rate_per_s > 0) == (self.concurrency > 0):
            raise ValueError(f"phase {self.name!r}: set exactly one of rate_per_s ({self.rate_per_s}) "
                             f"and concurrency ({self.concurrency})")
        if self.duration_s <= 0:
            raise ValueError(f"phase {self.name!r}: duration_s must be > 0, got {self.duration_s}")

    @property
    def open_loop(self) -> bool:
        return self.rate_per_s > 0

    def requests(self) -> tuple[TokenRequest, ...]:
        if self.open_loop:
            return make_requests(self.rate_per_s, self.duration_s, self.seed)
        return closed_loop_requests(NUM_CLOSED_LOOP_REQUESTS, self.seed)


NUM_CLOSED_LOOP_REQUESTS = 256
