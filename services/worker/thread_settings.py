"""Applies a worker's thread count to the libraries that would otherwise take every core.

Two moments, because the libraries read their settings at different times:
`export_thread_env` before torch or numba is imported (OpenMP, MKL and Numba size their
pools from the environment at load, for every thread, and whatever the worker starts
later inherits it); `set_library_threads` after import and before any parallel work
(torch's inter-op pool can be sized only once, before it first runs).
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

log = logging.getLogger(__name__)

THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def export_thread_env(num_threads: int, environ: MutableMapping[str, str] = os.environ) -> None:
    for name in THREAD_ENV_VARS:
        environ[name] = str(num_threads)


def set_library_threads(num_threads: int) -> None:
    """torch intra-op and inter-op pools, and Numba's, to num_threads (imports both)."""
    import numba
    import torch

    torch.set_num_threads(num_threads)
    try:
        torch.set_num_interop_threads(num_threads)
    except RuntimeError as exc:
        # Raised when the pool already ran (or was sized): the intra-op count above still holds.
        log.warning("torch inter-op threads stay at %d: %s", torch.get_num_interop_threads(), exc)
    # Numba's pool was sized from NUMBA_NUM_THREADS at import; this is the count for this thread.
    numba.set_num_threads(min(num_threads, numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]  # set at import from the environment
