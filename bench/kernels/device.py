"""What the CUDA device can do at best, for the kernel benchmarks' "% of peak" columns."""

from __future__ import annotations


def peak_bandwidth_gb_per_s() -> float | None:
    """Theoretical DRAM bandwidth: 2 transfers per memory clock across the bus (None where unknown)."""
    from numba import cuda

    try:
        device = cuda.get_current_device()
        clock_khz = device.MEMORY_CLOCK_RATE
        bus_bits = device.GLOBAL_MEMORY_BUS_WIDTH
    except AttributeError:  # the simulator has no real device
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9
