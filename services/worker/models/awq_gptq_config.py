"""An AWQ or GPTQ checkpoint's `quantization_config`, read into what loading needs: how many bits a
quantized Linear weight's values take, how many inputs share a scale and a zero, and how the zeros
are stored. The layouts themselves (which int32 holds which value) are awq_gptq_weights'.

Both store, for a Linear weight `[out, in]`, integer codes `q`, one zero `z` and one scale `s` per
group of inputs and output, and the weight is `(q - z) * s`. What a config may say:

* **awq** (AutoAWQ's GEMM format, as transformers' AwqConfig writes it): `{"quant_method": "awq",
  "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm"}` (vLLM also reads AutoAWQ's
  own spellings `w_bit` and `q_group_size`). Only 4 bits, zero points, and the `gemm` layout: `gemv`,
  `gemv_fast`, `marlin` and `exllama` are other layouts or kernels' repackings and are refused, as
  is a `backend` other than `autoawq` (llm-awq's own packing).
* **gptq** (AutoGPTQ, optimum, GPTQModel): `{"quant_method": "gptq", "bits": 4, "group_size": 128,
  "desc_act": false, "sym": true, "checkpoint_format": "gptq"}`: 4 or 8 bits; `group_size` -1 for
  one group over all inputs; `desc_act` (act-order) says each input's group is `g_idx[input]`,
  which is then required; `sym` changes nothing at load (the zeros are stored either way).
  `checkpoint_format` `gptq` (v1, the classic: each zero is stored minus one, read back plus one as
  AutoGPTQ, transformers and vLLM read it) or `gptq_v2` (GPTQModel's: zeros as they are). Refused:
  `marlin` and other repacked formats (`checkpoint_format`, `is_marlin_format`), per-module
  overrides (`dynamic`), packing into other than int32 (`pack_dtype`), 2 and 3 bits.

Which Linear weights are quantized is read from the weight files (a module stores `qweight` and its
companions, or a plain `weight`), as for FP8, so `modules_to_not_convert` (checked to be a list of
names) and GPTQ's `lm_head` need no reading. Runtime knobs (`do_fuse`, `use_exllama`,
`exllama_config`, `damp_percent`, `true_sequential`, `static_groups`, ...) change nothing in the
weights and are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.worker.models.fp8_config import Fail

AWQ, GPTQ = "awq", "gptq"
METHODS = (AWQ, GPTQ)
AWQ_BITS, GPTQ_BITS = (4,), (4, 8)
GPTQ_V1, GPTQ_V2 = "gptq", "gptq_v2"  # checkpoint_format: zeros stored minus one, or as they are
AWQ_GEMM = "gemm"
PACKED_BITS = 32  # every layout here packs its codes into int32


@dataclass(frozen=True)
class IntQuantization:
    """How a checkpoint's AWQ or GPTQ weights are stored: codes of `bits` bits, packed 32 // bits to an
    int32, one scale and zero per `group_size` inputs (None: one group over all of them)."""

    method: str  # AWQ or GPTQ
    bits: int
    group_size: int | None
    desc_act: bool = False  # GPTQ act-order: each input's group is stored (g_idx), not input // group_size
    zero_offset: int = 0  # added to each stored zero: 1 for GPTQ's v1 format (stored zero minus one)

    def __post_init__(self) -> None:
        if PACKED_BITS % self.bits or self.bits < 1:
            raise ValueError(f"bits must divide {PACKED_BITS}, got {self.bits}")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"group_size must be positive or None, got {self.group_size}")

    @property
    def pack_factor(self) -> int:
        """Codes (or zeros) per int32."""
        return PACKED_BITS // self.bits

    @property
    def part_names(self) -> tuple[str, ...]:
        """What a quantized `<module>.weight` is stored as, beside each other: `<module>.<part>`."""
        return ("qweight", "qzeros", "scales", "g_idx") if self.method == GPTQ else ("qweight", "qzeros", "scales")

    @property
    def required_parts(self) -> tuple[str, ...]:
        """The parts every quantized weight stores; g_idx may be left out only without act-order."""
        return self.part_names if self.desc_act else ("qweight", "qzeros", "scales")

    def num_groups(self, in_features: int) -> int:
        return 1 if self.group_size is None else in_features // self.group_size

    def part_shapes(self, weight_shape: tuple[int, int]) -> dict[str, tuple[int, ...]]:
        """Each part's shape for a weight of `weight_shape` ([out, in]), which layout_problem accepts."""
        out, in_ = weight_shape
        groups, packed_out = self.num_groups(in_), out // self.pack_factor
        if self.method == AWQ:  # packed along the outputs
            return {"qweight": (in_, packed_out), "qzeros": (groups, packed_out), "scales": (groups, out)}
        return {"qweight": (in_ // self.pack_factor, out), "qzeros": (groups, packed_out), "scales": (groups, out),
                "g_idx": (in_,)}

    def layout_problem(self, weight_shape: tuple[int, int]) -> str | None:
        """Why a weight of `weight_shape` ([out, in]) cannot be stored in this layout; None when it can."""
        out, in_ = weight_shape
        if self.group_size is not None and in_ % self.group_size:
            return f"its {in_} inputs are not a multiple of quantization_config.group_size {self.group_size}"
        if out % self.pack_factor:
            return f"its {out} outputs are not a multiple of {self.pack_factor} ({self.bits}-bit zeros per int32)"
        if self.method == GPTQ and in_ % self.pack_factor:
            return f"its {in_} inputs are not a multiple of {self.pack_factor} ({self.bits}-bit codes per int32)"
        return None


def read_int_quantization(raw: Mapping[str, Any], fail: Fail) -> IntQuantization:
    """An awq or gptq `quantization_config` (raw["quant_method"] is one of METHODS); `fail(field,
    problem)` makes the error for a field it does not read."""
    if raw["quant_method"] == AWQ:
        return _awq(raw, fail)
    return _gptq(raw, fail)


def _awq(raw: Mapping[str, Any], fail: Fail) -> IntQuantization:
    bits = _bits(raw, ("bits", "w_bit"), AWQ_BITS, fail)
    group_size = _group_size(raw, ("group_size", "q_group_size"), fail)
    version = raw.get("version", AWQ_GEMM)
    if not isinstance(version, str) or version.lower() != AWQ_GEMM:
        raise fail("version", f"{version!r} is not supported; supported: {AWQ_GEMM} (AutoAWQ's GEMM layout)")
    if raw.get("zero_point", True) is not True:
        raise fail("zero_point", f"{raw['zero_point']!r} is not supported; supported: true")
    backend = raw.get("backend", "autoawq")
    if backend != "autoawq":
        raise fail("backend", f"{backend!r} is not supported; supported: autoawq")
    _module_names(raw, fail)
    return IntQuantization(AWQ, bits, group_size)


def _gptq(raw: Mapping[str, Any], fail: Fail) -> IntQuantization:
    bits = _bits(raw, ("bits",), GPTQ_BITS, fail)
    group_size = _group_size(raw, ("group_size",), fail)
    desc_act = raw.get("desc_act", False)
    if desc_act not in (True, False):
        raise fail("desc_act", f"must be true or false, got {desc_act!r}")
    checkpoint_format = raw.get("checkpoint_format", GPTQ_V1)
    if checkpoint_format not in (GPTQ_V1, GPTQ_V2):
        raise fail("checkpoint_format", f"{checkpoint_format!r} is not supported; supported: {GPTQ_V1}, {GPTQ_V2}")
    if raw.get("is_marlin_format", False) is not False:
        raise fail("is_marlin_format", f"{raw['is_marlin_format']!r} is not supported; supported: false")
    pack_dtype = raw.get("pack_dtype", "int32")
    if pack_dtype not in ("int32", "torch.int32"):
        raise fail("pack_dtype", f"{pack_dtype!r} is not supported; supported: int32")
    if raw.get("dynamic"):  # GPTQModel: other bits or group sizes for the modules its patterns match
        raise fail("dynamic", "per-module overrides are not supported; supported: null or {}")
    _module_names(raw, fail)
    return IntQuantization(GPTQ, bits, group_size, desc_act=bool(desc_act),
                           zero_offset=1 if checkpoint_format == GPTQ_V1 else 0)


def _bits(raw: Mapping[str, Any], names: tuple[str, ...], supported: tuple[int, ...], fail: Fail) -> int:
    name = next((n for n in names if n in raw), names[0])
    bits = raw.get(name)
    # An int, not merely equal to one: 4.0 and True compare equal to 4 and 1.
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in supported:
        raise fail(name, f"{bits!r} is not supported; supported: {', '.join(map(str, supported))}")
    return bits


def _group_size(raw: Mapping[str, Any], names: tuple[str, ...], fail: Fail) -> int | None:
    name = next((n for n in names if n in raw), names[0])
    size = raw.get(name)
    if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
        raise fail(name, f"must be a positive int, or -1 for one group over all inputs, got {size!r}")
    return None if size == -1 else size


def _module_names(raw: Mapping[str, Any], fail: Fail) -> None:
    """modules_to_not_convert: only checked; what is quantized is read from the files."""
    names = raw.get("modules_to_not_convert")
    if names is not None and (not isinstance(names, list) or any(not isinstance(n, str) for n in names)):
        raise fail("modules_to_not_convert", f"must be a list of module names or null, got {names!r}")
