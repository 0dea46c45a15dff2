"""A thread block of Numba's CUDA simulator run without polling (cudasim_check.py installs it).

The simulator runs each CUDA thread of a block as a Python thread, and a syncthreads() (which the
simulated warp shuffles are made of) parks the thread until every live thread of the block has
reached one. numba 0.68's BlockManager.run finds that out by polling: it loops over the block's
threads, reading each one's flag and is_alive(), for as long as the block runs, and the loop holds
the GIL the simulated threads need. That was most of the check's CPU: test_kernel_backend's simulator test
(three such processes side by side) took 34 s of CPU and 30 s under CI=true, 107 s and 101 s whole
(INFERMESH_TEST_ALL=1), and 13 s / 10 s and 22 s / 17 s with the runner below (load ~4, 2 cores).

Here a parked or finished thread counts itself under the block's condition and the runner sleeps
until all are one or the other. What is simulated does not change: the same threads run the same
kernel, and a barrier opens when every thread still alive has reached it (numba's rule); the first
exception aborts the block and is raised, as numba does.
"""

from __future__ import annotations

import threading

import numpy as np
from numba.cuda.simulator import kernel as simulator

_thread_run = simulator.BlockThread.run


class _BlockState:
    """The block's threads that are parked in syncthreads() or finished, counted under `changed`."""

    def __init__(self, num_threads: int) -> None:
        self.changed = threading.Condition()
        self.num_threads = num_threads
        self.num_parked = 0
        self.num_finished = 0
        self.failed = False

    def settled(self) -> bool:
        """Every thread is parked or finished (a barrier to open, or the block is done), or one failed."""
        return self.failed or self.num_parked + self.num_finished == self.num_threads


def _run_thread(thread: simulator.BlockThread) -> None:
    try:
        _thread_run(thread)  # numba's: runs the kernel, keeps an exception in thread.exception
    finally:
        state = thread.block_state
        with state.changed:
            state.num_finished += 1
            state.failed = state.failed or thread.exception is not None
            if state.settled():
                state.changed.notify()


def _syncthreads(thread: simulator.BlockThread) -> None:
    if thread.abort:
        raise RuntimeError("abort flag set on syncthreads call")
    state = thread.block_state
    with state.changed:
        thread.syncthreads_blocked = True
        state.num_parked += 1
        if state.settled():
            state.changed.notify()
    thread.syncthreads_event.wait()
    thread.syncthreads_event.clear()
    if thread.abort:
        raise RuntimeError("abort flag set on syncthreads clear")


def _run_block(manager: simulator.BlockManager, grid_point, *args) -> None:
    def target() -> None:
        manager._f(*args)

    threads = [simulator.BlockThread(target, manager, grid_point, block_point, manager._debug)
               for block_point in np.ndindex(*manager._block_dim)]
    state = _BlockState(len(threads))
    for thread in threads:
        thread.block_state = state
    for thread in threads:
        thread.start()
    with state.changed:
        while True:
            state.changed.wait_for(state.settled)
            if state.failed or state.num_finished == state.num_threads:
                break
            for thread in threads:  # every live thread is parked: open the barrier
                if thread.syncthreads_blocked:
                    thread.syncthreads_blocked = False
                    thread.syncthreads_event.set()
            state.num_parked = 0
    for thread in threads:
        if thread.exception:
            for other in threads:
                other.abort = True
                other.syncthreads_blocked = False
                other.syncthreads_event.set()
            raise thread.exception[0].with_traceback(thread.exception[1])


def install() -> None:
    """Blocks launched from now on run as above (numba's simulator only: NUMBA_ENABLE_CUDASIM=1)."""
    simulator.BlockThread.run = _run_thread
    simulator.BlockThread.syncthreads = _syncthreads
    simulator.BlockManager.run = _run_block
