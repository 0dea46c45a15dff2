"""Closed-loop client threads for integration tests: each calls again as soon as its call ends."""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable

import grpc

from tools.testbed.processes import wait_until


def drive_until(call: Callable[[random.Random], str], until: Callable[[], bool], *, num_threads: int,
                timeout_s: float = 60.0, message: str = "the condition") -> Counter:
    """`call(rng)` from `num_threads` threads until `until()`: how often each answer (or failed
    call's status code name) was seen. Each thread has its own seeded rng."""
    seen: Counter = Counter()
    lock, stop = threading.Lock(), threading.Event()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            try:
                key = call(rng)
            except grpc.RpcError as exc:
                key = exc.code().name
            with lock:
                seen[key] += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(num_threads)]
    for thread in threads:
        thread.start()
    try:
        wait_until(until, timeout_s=timeout_s, interval_s=0.05, message=message)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    return seen
