"""Warp-lane exchanges for the CUDA attention kernels, with the simulator's stand-ins.

On a GPU these are warp shuffles (``shfl.sync``). Numba's simulator has none,
so there the same results go through a shared ``scratch`` array of one float
per thread and two block barriers: every thread of the block must call them,
which the kernels guarantee by calling them in block-uniform control flow.

* ``sum_lanes(value, width, scratch, tid)``: the sum over each aligned run of
  ``width`` lanes (a power of two ≤ 32), returned to each of them.
* ``max_lanes(value, width, scratch, tid)``: the same for the maximum.
* ``xor_lane(value, offset, scratch, tid)``: the value of lane ``lane ^ offset``.
"""

from __future__ import annotations

from numba import config, cuda, float32

SIMULATED = bool(config.ENABLE_CUDASIM)  # type: ignore[attr-defined]  # numba.config sets it at import from the environment
_FULL_MASK = 0xFFFFFFFF

if SIMULATED:

    @cuda.jit(device=True)
    def _share(value, scratch, tid):
        cuda.syncthreads()
        scratch[tid] = value
        cuda.syncthreads()

    @cuda.jit(device=True)
    def sum_lanes(value, width, scratch, tid):
        _share(value, scratch, tid)
        base = tid - tid % width
        total = float32(0.0)
        for i in range(width):
            total += scratch[base + i]
        return total

    @cuda.jit(device=True)
    def max_lanes(value, width, scratch, tid):
        _share(value, scratch, tid)
        base = tid - tid % width
        best = scratch[base]
        for i in range(1, width):
            if scratch[base + i] > best:
                best = scratch[base + i]
        return best

    @cuda.jit(device=True)
    def xor_lane(value, offset, scratch, tid):
        _share(value, scratch, tid)
        return scratch[tid ^ offset]

else:

    @cuda.jit(device=True, inline=True)
    def sum_lanes(value, width, scratch, tid):
        offset = width // 2
        while offset > 0:
            value += cuda.shfl_xor_sync(_FULL_MASK, value, offset)
            offset //= 2
        return value

    @cuda.jit(device=True, inline=True)
    def max_lanes(value, width, scratch, tid):
        offset = width // 2
        while offset > 0:
            other = cuda.shfl_xor_sync(_FULL_MASK, value, offset)
            if other > value:
                value = other
            offset //= 2
        return value

    @cuda.jit(device=True, inline=True)
    def xor_lane(value, offset, scratch, tid):
        return cuda.shfl_xor_sync(_FULL_MASK, value, offset)
