"""Whether this run takes the whole of the slowest sweeps or one case per variant.

`make test` under CI (CI=true, as CI runners set it) runs the quick form of a few sweeps that cost
minutes on a 2-core machine (the CUDA kernels on Numba's simulator); `make test-all` sets
INFERMESH_TEST_ALL=1 and runs them whole, as does any run outside CI.
"""

from __future__ import annotations

import os


def full_sweep() -> bool:
    if os.environ.get("INFERMESH_TEST_ALL", "").lower() in ("1", "true", "yes"):
        return True
    return os.environ.get("CI", "").lower() not in ("1", "true", "yes")
