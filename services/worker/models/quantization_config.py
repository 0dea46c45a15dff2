"""config.json's `quantization_config` → the scheme a checkpoint's Linear weights are stored in, all
of them dequantized at load to the compute dtype: FP8 (fp8_config: fp8 block-wise, compressed-tensors
FP8) or packed integers (awq_gptq_config: AWQ, GPTQ). Any other `quant_method` (bitsandbytes, mxfp4,
hqq, eetq, ...) is refused naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.worker.models.awq_gptq_config import METHODS as INT_METHODS
from services.worker.models.awq_gptq_config import IntQuantization, read_int_quantization
from services.worker.models.fp8_config import SUPPORTED_METHODS as FP8_METHODS
from services.worker.models.fp8_config import Fail, Fp8Quantization, read_fp8_quantization

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
