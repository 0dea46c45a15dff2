"""Compiles the kernels' CPU twins into Numba's on-disk cache, once, before the processes that call them.

    python -m tools.warm_kernels

The twins are `numba.njit(cache=True)`: the first process to call one compiles it (about 13 s of CPU
for the three, on the 2-core box) and writes kernels/__pycache__ (or NUMBA_CACHE_DIR); later
processes load it in milliseconds. On a fresh clone, `make test` starts many processes that call
them (test processes, workers in every mesh), and those that start before the cache is written
each compile the same code. `make test` runs this beside mypy first, so none does.

Each twin is called on tiny arrays of every signature the services use (float32, and float16 held
as uint16 for the cache scatter).
"""

from __future__ import annotations

import time

import numpy as np

from kernels import paged_attention_decode_host, preprocess_images, write_kv_cache_host


def warm() -> None:
    for dtype in (np.float32, np.uint16):  # the cache scatter's two signatures
        rows, cache = np.zeros((1, 2, 8), dtype), np.zeros((2, 4, 2, 8), dtype)
        write_kv_cache_host(rows, rows, cache, cache, np.zeros(1, np.int64))
    query, cache = np.zeros((1, 4, 8), np.float32), np.zeros((2, 4, 2, 8), np.float32)
    paged_attention_decode_host(np.empty_like(query), query, cache, cache, np.zeros((1, 2), np.int32),
                                np.ones(1, np.int32), 4, 1.0)
    preprocess_images([np.zeros((3, 3, 3), np.uint8)], 2, 2, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), backend="cpu")


def main() -> None:
    began = time.perf_counter()
    warm()
    print(f"kernels' CPU twins compiled or loaded from Numba's cache in {time.perf_counter() - began:.1f} s")


if __name__ == "__main__":
    main()
