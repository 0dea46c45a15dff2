"""An FP8 checkpoint's `quantization_config`, read into the one thing loading needs: how each quantized
Linear weight's scale is laid out and named.

Two schemes are read, both float8_e4m3fn weights with a scale each (the weight is `fp8 * scale`):

* **fp8** (transformers' FineGrainedFP8Config; DeepSeek-V3 and Qwen3-*-FP8 as released): `{"quant_method":
  "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}`. Each quantized
  `<module>.weight` has `<module>.weight_scale_inv`, float32 `[ceil(out / 128), ceil(in / 128)]`: one
  scale per block of the weight (despite the name, multiplied, as transformers and vLLM do).
* **compressed-tensors** (llm-compressor's FP8 and FP8-dynamic): `quant_method "compressed-tensors"`,
  format `float-quantized` or `naive-quantized`, `config_groups.*.weights` `{num_bits: 8, type: float,
  symmetric: true, strategy: tensor | channel | block}`. The scale is `<module>.weight_scale`: `[1]`
  (tensor), `[out, 1]` (channel) or per block as above (block, `block_structure`).

Activations stay unquantized. With `activation_scheme: "static"` (fp8) or static `input_activations`
(compressed-tensors) the checkpoint stores `<module>.input_scale` (transformers' fp8: `activation_scale`),
which is accepted and not used: the
weights dequantize to the same values, but the model was tuned with FP8 activations and is served with
full-precision ones, as vLLM serves these checkpoints on hardware without FP8 (about as accurate, not
bit-identical to FP8 serving).

Which weights are quantized is read from the weight files (each float8_e4m3fn Linear weight and its
scale; see fp8_weights), not from `ignore` / `modules_to_not_convert`: an ignored lm_head or router is
stored in the checkpoint's dtype and read as such. Everything else a config may say is refused naming
the field: int8 and 4-bit compressed-tensors schemes, e5m2, UE8M0 scales, quantized output
activations, sparse storage and transforms, and an FP8 KV cache (`kv_cache_scheme`, not implemented:
the KV cache is float32). quantization_config chooses between this module and awq_gptq_config by
`quant_method`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

FP8, COMPRESSED_TENSORS = "fp8", "compressed-tensors"
SUPPORTED_METHODS = (FP8, COMPRESSED_TENSORS)
# How one scale covers its weight: one block of rows x columns each (`block`), the whole tensor, or a row.
PER_BLOCK, PER_TENSOR, PER_CHANNEL = "block", "tensor", "channel"
COMPRESSED_FORMATS = ("float-quantized", "naive-quantized")

Fail = Callable[[str, str], Exception]  # (field under quantization_config., problem) -> the error to raise


@dataclass(frozen=True)
class Fp8Quantization:
    """How a checkpoint's FP8 weights are scaled: every quantized weight is float8_e4m3fn, and
    `<module>.<scale_name>` multiplies it, one value per `granularity` (per block: `block` = (rows, cols))."""

    method: str  # FP8 or COMPRESSED_TENSORS
    scale_name: str  # "weight_scale_inv" (fp8) or "weight_scale" (compressed-tensors)
    granularity: str  # PER_BLOCK, PER_TENSOR or PER_CHANNEL
    block: tuple[int, int] | None = None  # PER_BLOCK: rows and columns of the weight one scale covers
    static_activations: bool = False  # `<module>.input_scale` tensors are stored (and not used)

    def __post_init__(self) -> None:
        if (self.granularity == PER_BLOCK) != (self.block is not None):
            raise ValueError(f"a block size goes with per-block scales only, got {self.granularity} and {self.block}")
        if self.block is not None and min(self.block) < 1:
            raise ValueError(f"block sizes must be positive, got {self.block}")

    @property
    def input_scale_names(self) -> tuple[str, ...]:
        """What a static activation scale is stored as beside its weight (vLLM's name, and transformers'
        for fp8); () with dynamic activations, whose scales are computed per token and never stored."""
        if not self.static_activations:
            return ()
        return ("input_scale", "activation_scale") if self.method == FP8 else ("input_scale",)

    def scale_shapes(self, weight_shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """The shapes a weight of `weight_shape` ([out, in]) may have its scale stored in."""
        out, in_ = weight_shape
        if self.granularity == PER_TENSOR:
            return ((1,), ())  # llm-compressor writes [1]; a scalar says the same
        if self.granularity == PER_CHANNEL:
            return ((out, 1),)
        assert self.block is not None
        return ((-(-out // self.block[0]), -(-in_ // self.block[1])),)


def read_fp8_quantization(raw: Mapping[str, Any], fail: Fail) -> Fp8Quantization:
    """An fp8 or compressed-tensors `quantization_config` (raw["quant_method"] is one of
    SUPPORTED_METHODS); `fail(field, problem)` makes the error for a field (named under
    quantization_config.) that is not an FP8 scheme read here."""
    if raw["quant_method"] == FP8:
        return _fine_grained_fp8(raw, fail)
    return _compressed_tensors(raw, fail)


def _fine_grained_fp8(raw: Mapping[str, Any], fail: Fail) -> Fp8Quantization:
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise fail("fmt", f"{fmt!r} is not supported; supported: e4m3")
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise fail("activation_scheme", f"{scheme!r} is not supported; supported: dynamic, static")
    scale_fmt = raw.get("scale_fmt", "float")
    if scale_fmt != "float":  # DeepSeek-V4's UE8M0 (float8_e8m0fnu) scales
        raise fail("scale_fmt", f"{scale_fmt!r} is not supported; supported: float")
    expert_dtype = raw.get("expert_dtype", "fp8")
    if expert_dtype != "fp8":
        raise fail("expert_dtype", f"{expert_dtype!r} is not supported; supported: fp8")
    if raw.get("modules_to_convert"):  # embeddings quantized too
        raise fail("modules_to_convert", f"{raw['modules_to_convert']!r} is not supported; supported: null "
                   "(Linear weights only)")
    # transformers reads an absent block size as 128 x 128, vLLM as per-tensor scales named weight_scale:
    # a checkpoint that does not say is not guessed at.
    block = _block(raw.get("weight_block_size"), "weight_block_size", fail)
    return Fp8Quantization(FP8, "weight_scale_inv", PER_BLOCK, block, static_activations=scheme == "static")


def _compressed_tensors(raw: Mapping[str, Any], fail: Fail) -> Fp8Quantization:
    if raw.get("format") not in COMPRESSED_FORMATS:
        raise fail("format", f"{raw.get('format')!r} is not supported; supported: {', '.join(COMPRESSED_FORMATS)} "
                   "(FP8 weights)")
    status = raw.get("quantization_status", "compressed")
    if status != "compressed":
        raise fail("quantization_status", f"{status!r} is not supported; supported: compressed")
    if raw.get("kv_cache_scheme") is not None:
        raise fail("kv_cache_scheme", "an FP8 KV cache is not supported (the KV cache is float32); supported: null")
    if raw.get("transform_config") is not None:  # rotations (SpinQuant, QuIP) folded around the weights
        raise fail("transform_config", "transforms are not supported; supported: null")
    sparsity = raw.get("sparsity_config")
    if sparsity is not None and (not isinstance(sparsity, Mapping) or sparsity.get("format") != "dense"):
        raise fail("sparsity_config", f"{sparsity!r} is not supported; supported: null, or format dense "
                   "(weights stored whole)")
    groups = raw.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise fail("config_groups", f"must be a non-empty object of quantization groups, got {groups!r}")
    schemes = {name: _group(group, f"config_groups.{name}.", fail) for name, group in groups.items()}
    first, *others = schemes.items()
    for name, scheme in others:
        if scheme != first[1]:
            raise fail(f"config_groups.{name}", f"quantizes weights otherwise than config_groups.{first[0]}: "
                       "one weight scheme per checkpoint is supported")
    return first[1]


def _group(group: Any, at: str, fail: Fail) -> Fp8Quantization:
    if not isinstance(group, Mapping):
        raise fail(at.rstrip("."), f"must be an object, got {group!r}")
    if group.get("format") not in (None, *COMPRESSED_FORMATS):
        raise fail(f"{at}format", f"{group['format']!r} is not supported; supported: {', '.join(COMPRESSED_FORMATS)}")
    if group.get("output_activations") is not None:
        raise fail(f"{at}output_activations", "quantized outputs are not supported; supported: null")
    granularity, block = _weights(group.get("weights"), f"{at}weights.", fail)
    static = _input_activations(group.get("input_activations"), f"{at}input_activations.", fail)
    return Fp8Quantization(COMPRESSED_TENSORS, "weight_scale", granularity, block, static_activations=static)


def _weights(weights: Any, at: str, fail: Fail) -> tuple[str, tuple[int, int] | None]:
    if not isinstance(weights, Mapping):
        raise fail(at.rstrip("."), f"must be an object (the weights' scheme), got {weights!r}")
    _float8(weights, at, fail)
    if weights.get("symmetric", True) is not True:
        raise fail(f"{at}symmetric", f"{weights['symmetric']!r} is not supported; supported: true")
    if weights.get("dynamic", False) is not False:
        raise fail(f"{at}dynamic", f"{weights['dynamic']!r} is not supported; supported: false")
    strategy = weights.get("strategy")
    if strategy not in (PER_TENSOR, PER_CHANNEL, PER_BLOCK):
        raise fail(f"{at}strategy", f"{strategy!r} is not supported; supported: {PER_TENSOR}, {PER_CHANNEL}, "
                   f"{PER_BLOCK}")
    if strategy != PER_BLOCK:
        return strategy, None
    return strategy, _block(weights.get("block_structure"), f"{at}block_structure", fail)


def _input_activations(activations: Any, at: str, fail: Fail) -> bool:
    """Whether the activations' scales are static (stored as input_scale); they are not applied."""
    if activations is None:
        return False
    if not isinstance(activations, Mapping):
        raise fail(at.rstrip("."), f"must be an object or null, got {activations!r}")
    _float8(activations, at, fail)
    dynamic = activations.get("dynamic", False)
    if dynamic not in (True, False):  # "local" (NVFP4's global-plus-local scales)
        raise fail(f"{at}dynamic", f"{dynamic!r} is not supported; supported: true, false")
    return not dynamic


def _float8(scheme: Mapping[str, Any], at: str, fail: Fail) -> None:
    if scheme.get("type") != "float":
        raise fail(f"{at}type", f"{scheme.get('type')!r} is not supported; supported: float (int8 and int4 "
                   "schemes are not)")
    if scheme.get("num_bits") != 8:
        raise fail(f"{at}num_bits", f"{scheme.get('num_bits')!r} is not supported; supported: 8")


def _block(value: Any, field: str, fail: Fail) -> tuple[int, int]:
    if (not isinstance(value, list) or len(value) != 2
            or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in value)):
        raise fail(field, f"must be [rows, columns], two positive ints, got {value!r}")
    return value[0], value[1]
