"""Hands the C allocator's free pages back to the OS once a model is loaded.

Loading frees a lot of small and medium blocks (the safetensors headers, the warm-up step's and the
golden check's activations, a private KV cache for the golden prompts), spread over the arenas of the
threads that loaded. glibc returns only what sits at the top of each arena, so the rest stays
resident for the life of the process; `malloc_trim(0)` also gives back the free pages inside them.
On the medium Llama of bench/worker/bench_hf_llm.py that was 4-6 MiB of the worker's RSS.
Elsewhere (musl, macOS) there is nothing to call and nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError, TypeError):  # no libc by that name, or not glibc (no malloc_trim)
        return None
    return libc


def trim_native_heap() -> bool:
    """glibc's malloc_trim(0): True when it ran (whether or not it found pages to give back)."""
    libc = _libc()
    if libc is None:
        log.debug("no glibc malloc_trim here: the native heap is left as it is")
        return False
    libc.malloc_trim(0)
    return True
