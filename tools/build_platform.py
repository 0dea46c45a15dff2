"""What a trained model's bits depend on besides its recipe: the platform that built it.

With fixed seeds, one thread count and deterministic algorithms, a rebuild is
bit-identical only on the same torch build *and* the same instruction-set paths:
ATen's vectorized kernels (reductions, softmax, elementwise) are compiled per
CPU capability, oneDNN's convolutions are JIT-compiled per ISA, and MKL picks
its GEMM kernels by CPU. Their rounding differs, and training amplifies the
difference (issue 31: an AVX-512/AMX machine rebuilt other weights than the
AVX-512 machine that shipped them). The build records these, as strings in the
manifest's `build` block, so a verifier can tell whether it may expect the
same bits.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

# The manifest `build` keys a platform is recorded under; a rebuild is expected to be
# bit-identical only when every one of them matches.
PLATFORM_KEYS = ("torch", "numpy", "aten_cpu_capability", "onednn_isa", "cpu", "mkl_env")
# MKL picks its kernels by CPU unless told otherwise; these say otherwise.
MKL_ENV = ("MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE")
UNKNOWN = "unknown"


def current_platform(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    """This process's platform, keyed by PLATFORM_KEYS."""
    return {
        "torch": torch.__version__,
        "numpy": np.__version__,
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_isa": onednn_isa(),
        "cpu": cpu_model(cpuinfo.read_text() if cpuinfo.is_file() else ""),
        "mkl_env": mkl_env(os.environ),
    }


def recorded_platform(build: Mapping[str, str]) -> dict[str, str]:
    """The platform fields a manifest's `build` block holds (missing ones are absent)."""
    return {k: build[k] for k in PLATFORM_KEYS if k in build}


def platform_differences(recorded: Mapping[str, str], current: Mapping[str, str]) -> list[str]:
    """Why a build on `current` may not reproduce the bits recorded with `recorded` (empty: it should).

    A key missing or "unknown" on either side counts as a difference: equal bits are only
    promised for a platform known to be the same.
    """
    reasons = []
    for key in PLATFORM_KEYS:
        was, now = recorded.get(key, UNKNOWN), current.get(key, UNKNOWN)
        if was == UNKNOWN or now == UNKNOWN:
            reasons.append(f"{key} not recorded (shipped {was!r}, rebuilt {now!r})")
        elif was != now:
            reasons.append(f"{key} {now!r} != recorded {was!r}")
    return reasons


def mkl_env(environ: Mapping[str, str]) -> str:
    """The MKL dispatch settings in `environ`, e.g. "MKL_CBWR=COMPATIBLE", or "unset"."""
    return ";".join(f"{k}={environ[k]}" for k in MKL_ENV if k in environ) or "unset"


def cpu_model(cpuinfo_text: str) -> str:
    """'<vendor> family <f> model <m>: <model name>' of the first processor in /proc/cpuinfo text."""
    fields: dict[str, str] = {}
    for line in cpuinfo_text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if "vendor_id" not in fields:
        return UNKNOWN
    return (f"{fields['vendor_id']} family {fields.get('cpu family', '?')} model {fields.get('model', '?')}: "
            f"{fields.get('model name', '?')}")


@functools.cache
def onednn_isa() -> str:
    """The ISA oneDNN dispatches to here, as its verbose header names it ("unknown" if it cannot tell).

    oneDNN says it only in that header, which it writes to the C stdout once per process when
    a primitive first runs with verbose on; hence the file-descriptor capture and the cache.
    """
    if not torch.backends.mkldnn.is_available():
        return "none (torch built without oneDNN)"
    sys.stdout.flush()  # what Python holds for fd 1 goes out before fd 1 is borrowed
    with tempfile.TemporaryFile() as captured:
        saved = os.dup(1)
        try:
            os.dup2(captured.fileno(), 1)
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                # A batch of 8 (a lone image takes ATen's own path, not oneDNN's).
                torch.nn.functional.conv2d(torch.ones(8, 16, 8, 8), torch.ones(16, 16, 3, 3))
            ctypes.CDLL(None).fflush(None)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        captured.seek(0)
        text = captured.read().decode(errors="replace")
    for line in text.splitlines():
        if ",info,cpu,isa:" in line:
            return line.split(",info,cpu,isa:", 1)[1].strip()
    return UNKNOWN
