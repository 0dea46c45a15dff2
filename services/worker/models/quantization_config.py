"""config.json's `quantization_config` → the scheme a checkpoint's Linear weights are stored in, all
of them dequantized at load to the compute dtype: FP8 (fp8_config: fp8 block-wise, compressed-tensors
FP8) or packed integers (awq_gptq_config: AWQ, GPTQ). Any other `quant_method` (bitsandbytes, mxfp4,
hqq, eetq, ...) is refused naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.worker.models.awq_gptq_config import AWQ, IntQuantization, read_int_quantization
from services.worker.models.awq_gptq_config import METHODS as INT_METHODS
from services.worker.models.fp8_config import PER_BLOCK, Fail, Fp8Quantization, read_fp8_quantization
from services.worker.models.fp8_config import SUPPORTED_METHODS as FP8_METHODS

Quantization = Fp8Quantization | IntQuantization
SUPPORTED_METHODS = (*FP8_METHODS, *INT_METHODS)


def read_quantization(raw: Any, fail: Fail) -> Quantization | None:
    """`quantization_config` (None when absent or null); `fail(field, problem)` makes the error for a
    field (named under quantization_config.) that no scheme here reads."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise fail("", f"must be an object or null, got {raw!r}")
    method = raw.get("quant_method")
    if method in FP8_METHODS:
        return read_fp8_quantization(raw, fail)
    if method in INT_METHODS:
        return read_int_quantization(raw, fail)
    raise fail("quant_method", f"{method!r} is not supported; supported: {', '.join(SUPPORTED_METHODS)} "
               "(dequantized at load)")


def describe(quantization: Quantization) -> str:
    """The scheme in a few words, for a person: "gptq 4-bit, group_size 128, act-order (v1 zeros)"."""
    q = quantization
    if isinstance(q, Fp8Quantization):
        per = f"{q.block[0]} x {q.block[1]} blocks" if q.granularity == PER_BLOCK and q.block else q.granularity
        return f"{q.method} FP8 (e4m3), a scale per {per}"
    group = "one group" if q.group_size is None else f"group_size {q.group_size}"
    if q.method == AWQ:
        return f"awq {q.bits}-bit, {group} (GEMM layout)"
    order = ", act-order" if q.desc_act else ""
    return f"gptq {q.bits}-bit, {group}{order} ({'v1' if q.zero_offset else 'v2'} zeros)"
