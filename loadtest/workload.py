"""Turns a scenario into concrete requests: who sends what, and when it is due."""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from loadtest.arrivals import arrival_times_s
from loadtest.payloads import (
    ImagePayload,
    TensorPayload,
    TextPayload,
    make_image_pool,
    make_prompt,
    make_tensor_pool,
)
from loadtest.prompts import SharedText, block_prompt, with_prefix
from loadtest.scenario import ClassSpec, RequestKind, Scenario, TenantSpec, TraceSpec
from loadtest.trace import TraceEntry


@dataclass(frozen=True)
class SessionTurn:
    session_id: int  # the seq of the session's first turn
    turn: int  # 1-based
    num_turns: int


@dataclass(frozen=True)
class PlannedRequest:
    seq: int
    scheduled_s: float  # due time, seconds from the run's start
    tenant: TenantSpec
    request_class: ClassSpec
    payload: ImagePayload | TextPayload | TensorPayload
    payload_key: int  # stable id of the payload, so a sender may cache encoded messages
    session: SessionTurn | None = None  # a turn of a multi-turn session


class WorkloadSampler:
    """Draws tenant, class and payload per request from the scenario's shares, reproducibly."""

    def __init__(self, scenario: Scenario, rng: np.random.Generator) -> None:
        self._rng = rng
        self._tenants = scenario.tenants
        self._tenant_cdf = _cdf([t.share for t in scenario.tenants])
        self._classes = scenario.classes
        self._class_cdf = _cdf([c.share for c in scenario.classes])
        self._pools: dict[str, tuple[ImagePayload, ...] | tuple[TensorPayload, ...]] = {}
        for c in scenario.classes:  # in class order, so each pool's draws are the same run to run
            if c.kind is RequestKind.CLASSIFY and c.image is not None:
                self._pools[c.name] = make_image_pool(c.image, rng)
            elif c.kind is RequestKind.TENSOR and c.tensor is not None:
                self._pools[c.name] = make_tensor_pool(c.tensor, rng)
        self._shared = SharedText(scenario.seed)

    def draw_tenant(self) -> TenantSpec:
        return self._tenants[self._pick(self._tenant_cdf)]

    def draw(self, seq: int, scheduled_s: float) -> PlannedRequest:
        tenant = self.draw_tenant()
        class_index = self._pick(self._class_cdf)
        request_class = self._classes[class_index]
        if request_class.kind is not RequestKind.GENERATE:
            pool = self._pools[request_class.name]
            variant = int(self._rng.integers(len(pool)))
            payload: ImagePayload | TextPayload | TensorPayload = pool[variant]
            key = class_index * 1_000_003 + variant
        else:
            # scenario.py gives every generate class both distributions (defaults when unset).
            assert request_class.prompt_len is not None and request_class.output_len is not None
            prompt = self._prompt(request_class, request_class.prompt_len.sample(self._rng))
            payload = TextPayload(prompt, request_class.output_len.sample(self._rng))
            key = -1  # prompts are not reused
        session = None
        if request_class.session_turns is not None:
            session = SessionTurn(seq, 1, request_class.session_turns.sample(self._rng))
        return PlannedRequest(seq, scheduled_s, tenant, request_class, payload, key, session)

    def _pick(self, cdf: tuple[float, ...]) -> int:
        """An index drawn by its share: one uniform and a bisection (Generator.choice with p costs
        ~30 us a call, twice per request, on the generator's loop)."""
        return min(bisect.bisect_right(cdf, self._rng.random()), len(cdf) - 1)

    def _prompt(self, c: ClassSpec, num_bytes: int) -> str:
        """Fresh words, after one of the class's shared prefixes when it sets a ratio."""
        shared_len = round(c.shared_prefix_ratio * num_bytes)
        if shared_len == 0:
            return make_prompt(num_bytes, self._rng)
        group = int(self._rng.integers(c.num_shared_prefixes))
        return with_prefix(self._shared.text(f"class:{c.name}:{group}", shared_len), num_bytes, self._rng)

    def replay(self, seq: int, spec: TraceSpec, entry: TraceEntry) -> PlannedRequest:
        """A trace's request: its time and lengths, its prefix (hash-id blocks or a prefix group), a drawn tenant."""
        request_class = next(c for c in self._classes if c.name == spec.class_name)
        if entry.hash_ids:
            prompt = block_prompt(self._shared, entry.hash_ids, spec.block_tokens, entry.input_len, self._rng)
        elif entry.prefix_group and entry.prefix_len:
            prompt = with_prefix(self._shared.text(f"group:{entry.prefix_group}", entry.prefix_len), entry.input_len,
                                 self._rng)
        else:
            prompt = make_prompt(entry.input_len, self._rng)
        return PlannedRequest(seq, entry.t_s / spec.speedup, self.draw_tenant(), request_class,
                              TextPayload(prompt, entry.output_len), -1)


def _cdf(shares: list[float]) -> tuple[float, ...]:
    """Cumulative shares, normalized to end at 1."""
    total = sum(shares)
    return tuple(float(x) for x in np.cumsum(shares) / total)


def open_loop_plan(scenario: Scenario) -> Iterator[PlannedRequest]:
    """Every request of an open-loop run, in due order. Arrival times and payloads use separate
    random streams, so changing the request mix does not move the arrivals."""
    sampler = WorkloadSampler(scenario, np.random.default_rng([scenario.seed, 2]))
    if scenario.trace is not None:
        for seq, entry in enumerate(scenario.trace.entries):
            yield sampler.replay(seq, scenario.trace, entry)
        return
    arrivals_rng = np.random.default_rng([scenario.seed, 1])
    times = arrival_times_s(scenario.schedule(), scenario.load.arrival, arrivals_rng, scenario.load.burstiness)
    for seq, t_s in enumerate(times):
        yield sampler.draw(seq, t_s)


class SessionTurns:
    """The next turn of a session, once a turn's reply is in: the whole conversation so far (every
    prompt and reply) plus a new message, due a think time after the reply. Its own random stream,
    so sessions do not move the open-loop plan's draws; turns get seqs above any plan's."""

    FIRST_SEQ = 1 << 40

    def __init__(self, scenario: Scenario) -> None:
        self._rng = np.random.default_rng([scenario.seed, 4])
        self._next_seq = self.FIRST_SEQ

    def next_turn(self, done: PlannedRequest, reply_text: str, replied_s: float) -> PlannedRequest | None:
        """None when the session is over. `replied_s`: when the reply ended, seconds from the run's start."""
        session = done.session
        if session is None or session.turn >= session.num_turns:
            return None
        c = done.request_class
        assert isinstance(done.payload, TextPayload) and c.prompt_len is not None and c.output_len is not None
        assert c.session_think_ms is not None  # set with session_turns (scenario.py)
        message = make_prompt(c.prompt_len.sample(self._rng), self._rng)
        think_s = c.session_think_ms.sample(self._rng) / 1000
        self._next_seq += 1
        return PlannedRequest(self._next_seq, replied_s + think_s, done.tenant, c,
                              TextPayload(f"{done.payload.prompt}{reply_text}\n{message}",
                                          c.output_len.sample(self._rng)), -1,
                              SessionTurn(session.session_id, session.turn + 1, session.num_turns))
