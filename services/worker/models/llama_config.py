"""The Llama family's architecture, read from a Hugging Face `config.json`.

One frozen `LlamaFamilyConfig` covers LlamaForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM, MistralForCausalLM, Phi3ForCausalLM, GraniteForCausalLM,
SmolLM3ForCausalLM, Olmo2ForCausalLM, Gemma2ForCausalLM and Gemma3ForCausalLM,
and the mixture-of-experts MixtralForCausalLM, Qwen2MoeForCausalLM and
Qwen3MoeForCausalLM: they are one decoder (RMSNorm, RoPE, grouped-query
attention, a gated MLP or a routed set of gated experts) and differ only in the
fields this dataclass names: qkv bias (Qwen2), q/k norms per
head (Qwen3, Gemma 3) or over the whole projection (OLMo 2), norms after each
branch instead of (OLMo 2) or beside (Gemma) those before, projections stored
fused (Phi-3), Granite's four scalings, Gemma's (1 + w) norms, GELU-tanh,
embedding scale and softcaps, layers without RoPE (SmolLM3), tied embeddings,
rope scaling, and each layer's sliding window (with Gemma 3's own RoPE base for
its sliding layers). Everything else a config may say is either irrelevant to
inference (dropout, initializer range) or refused with a `CheckpointError`
naming the field and what is supported, so a checkpoint we cannot compute
exactly is never served approximately.

Mixture of experts (`ExpertsConfig`): Mixtral's every layer, and the Qwen MoE
layers that mlp_only_layers and decoder_sparse_step leave sparse, route each
token to num_experts_per_tok of num_experts gated MLPs (Qwen2-MoE adds a shared
expert behind a sigmoid gate). The router's training settings are read by
nobody at inference, here as in transformers' eval mode: output_router_logits
and router_aux_loss_coef feed the load-balancing loss, router_jitter_noise
(Mixtral) multiplies the input only while training. They are ignored.

A quantized checkpoint (`quantization_config`: fp8 block-wise or compressed-tensors FP8; AWQ or GPTQ)
is the same model with its Linear weights stored as float8 and scales, or as packed integers with
scales and zeros; quantization_config reads the scheme (refusing, naming the field, every other), and
the weights are dequantized at load (fp8_weights, awq_gptq_weights).

Both spellings of RoPE settings are read: transformers 4's top-level
`rope_theta` with `rope_scaling` (keyed `type` or `rope_type`), and
transformers 5's `rope_parameters`.

Gemma3ForConditionalGeneration (Gemma 3 4B and up: vision and text) is served
text-only, as vLLM serves it a text prompt: its `text_config` is read as a
Gemma3ForCausalLM config, with transformers' defaults for the keys released
configs leave out, and its errors name the field as `text_config.<name>`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, TypeGuard

from services.worker.models.quantization_config import Quantization, read_quantization

# q/k norms: over each head (weights of head_size) or over the whole projection (num_heads * head_size).
QK_NORM_PER_HEAD, QK_NORM_FULL = "head", "full"
# How an architecture reads a config's sliding_window: not at all (its attention has none), on every
# layer, only with use_sliding_window set (Qwen2's switch, with max_window_layers), or on the layers a
# pattern picks (Gemma: every layer but each sliding_window_pattern-th).
WINDOW_NONE, WINDOW_ALWAYS, WINDOW_SWITCHED, WINDOW_PATTERN = "none", "always", "switched", "pattern"
# How a mixture-of-experts config says its experts. Qwen: num_experts of moe_intermediate_size, sparse
# layers by mlp_only_layers and decoder_sparse_step, top-k renormalized only with norm_topk_prob, the
# routing weights cast to the compute dtype. Mixtral: num_local_experts of intermediate_size on every
# layer, top-k always renormalized, the routing weights kept in float32 (as transformers computes each).
EXPERTS_QWEN, EXPERTS_MIXTRAL = "qwen", "mixtral"


@dataclass(frozen=True)
class _Traits:
    """What an architecture fixes, as transformers' modeling code for it does."""

    qkv_bias: bool = False
    qk_norm: str = ""
    pre_norms: bool = True
    post_norms: bool = False
    fused_projections: bool = False
    window: str = WINDOW_NONE
    scalings: bool = False  # Granite's four scalings are read from the config
    nope_layers: bool = False  # SmolLM3's layers without RoPE are read from the config
    # Gemma 2/3: (1 + w) norms, GELU-tanh, the sqrt(d_model) embedding scale, query_pre_attn_scalar,
    # sliding layers by pattern, and the softcaps, all read as transformers' Gemma code reads them.
    gemma: bool = False
    local_rope: bool = False  # Gemma 3: the sliding layers have their own RoPE base
    window_pattern: int = 0  # WINDOW_PATTERN: every window_pattern-th layer is full (config may override)
    tied_by_default: bool = False  # what a config without tie_word_embeddings means (transformers' default)
    default_rope_theta: float = 10000.0  # what a config without rope_theta means (Gemma 3's: 1e6)
    # A vision + text checkpoint served text-only: the language model is described by config.json's
    # text_config, whose absent keys take these defaults (its config class's); None: config.json is flat.
    text_config_defaults: Mapping[str, Any] | None = None
    experts: str = ""  # EXPERTS_QWEN or EXPERTS_MIXTRAL: how the config says its experts; "": dense
    shared_expert: bool = False  # Qwen2-MoE: a shared expert beside the routed ones
    # A base model (Qwen2Model, MistralModel, ...: what embedding checkpoints such as gte-Qwen2 and
    # e5-mistral declare): the decoder without an LM head, its tensors stored without the `model.` prefix.
    base_model: bool = False


# transformers' Gemma3TextConfig defaults (models/gemma3/configuration_gemma3.py, the same in 4.50 and
# 5.24; the RoPE bases are 5's default_theta): released Gemma3ForConditionalGeneration configs leave
# these out of text_config. hidden_size, intermediate_size and num_hidden_layers, which every released
# config states, stay required.
GEMMA3_TEXT_DEFAULTS: Mapping[str, Any] = MappingProxyType({
    "vocab_size": 262208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
})
_GEMMA3 = _Traits(qk_norm=QK_NORM_PER_HEAD, post_norms=True, window=WINDOW_PATTERN, window_pattern=6, gemma=True,
                  local_rope=True, tied_by_default=True, default_rope_theta=1000000.0)
_TRAITS = {
    "Gemma2ForCausalLM": _Traits(post_norms=True, window=WINDOW_PATTERN, window_pattern=2, gemma=True,
                                 tied_by_default=True),
    "Gemma3ForCausalLM": _GEMMA3,
    "Gemma3ForConditionalGeneration": replace(_GEMMA3, text_config_defaults=GEMMA3_TEXT_DEFAULTS),
    "GraniteForCausalLM": _Traits(scalings=True),
    "LlamaForCausalLM": _Traits(),
    "MistralForCausalLM": _Traits(window=WINDOW_ALWAYS),
    "MixtralForCausalLM": _Traits(window=WINDOW_ALWAYS, experts=EXPERTS_MIXTRAL),
    "Olmo2ForCausalLM": _Traits(qk_norm=QK_NORM_FULL, pre_norms=False, post_norms=True),
    "Phi3ForCausalLM": _Traits(fused_projections=True, window=WINDOW_ALWAYS),
    "Qwen2ForCausalLM": _Traits(qkv_bias=True, window=WINDOW_SWITCHED),
    "Qwen2MoeForCausalLM": _Traits(qkv_bias=True, experts=EXPERTS_QWEN, shared_expert=True),
    "Qwen3ForCausalLM": _Traits(qk_norm=QK_NORM_PER_HEAD, window=WINDOW_SWITCHED),
    "Qwen3MoeForCausalLM": _Traits(qk_norm=QK_NORM_PER_HEAD, experts=EXPERTS_QWEN),
    "SmolLM3ForCausalLM": _Traits(window=WINDOW_SWITCHED, nope_layers=True, tied_by_default=True),
}
# The base models of the dense decoders, as sentence-transformers embedding checkpoints declare them.
_TRAITS.update({name.replace("ForCausalLM", "Model"): replace(_TRAITS[name], base_model=True) for name in
                ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")})
SUPPORTED_ARCHITECTURES = tuple(sorted(_TRAITS))
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SUPPORTED_ACTIVATIONS = ("silu",)
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)
MAX_LAYERS = 1024  # released decoders have up to ~130; a config saying 10**12 must not build 10**12 of anything
MAX_EXPERTS = 4096  # released mixtures have up to 512 a layer; the expected tensors are listed per expert
# What a config's `dtype` (transformers 5) or `torch_dtype` (4) may declare the stored weights as.
SUPPORTED_STORAGE_DTYPES = ("float32", "float16", "bfloat16")


class CheckpointError(ValueError):
    """A checkpoint we refuse: `file` and `field` say where (`config.json`, `rope_scaling.rope_type`;
    `model.safetensors`, `model.layers.0.self_attn.q_proj.weight`)."""

    def __init__(self, file: str, field: str, problem: str) -> None:
        super().__init__(f"{file}: {field}: {problem}")
        self.file = file
        self.field = field
        self.problem = problem


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent stretch of RoPE: long wavelengths divided by `factor`, short
    ones kept, the band between interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LinearRopeScaling:
    """Position interpolation: every frequency divided by `factor`."""

    factor: float


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN (Qwen2.5's and Qwen3's long-context setting): frequencies that turn fewer than `beta_slow`
    times over the original context are divided by `factor`, those turning more than `beta_fast` times
    kept, a linear ramp between; cos and sin are multiplied by `attention_factor`."""

    factor: float
    original_max_position_embeddings: int
    attention_factor: float  # resolved from the config's attention_factor, or mscale / mscale_all_dim, or factor
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # the ramp's ends rounded outwards to whole dimensions


RopeScaling = Llama3RopeScaling | LinearRopeScaling | YarnRopeScaling


@dataclass(frozen=True)
class ExpertsConfig:
    """A mixture of experts in place of some layers' MLP: each token's router picks `top_k` of
    `num_experts` gated MLPs, whose outputs it sums weighted by the routing probabilities."""

    num_experts: int
    top_k: int  # num_experts_per_tok
    d_ff: int  # each expert's intermediate size (Qwen: moe_intermediate_size; Mixtral: intermediate_size)
    layers: tuple[int, ...]  # the layers whose MLP is the experts; the others keep the dense MLP of d_ff
    # The top-k probabilities divided by their sum (Qwen's norm_topk_prob; Mixtral always), else kept as
    # the softmax over all experts gave them.
    renormalize: bool
    # Mixtral keeps the routing weights in float32 (a token's weighted sum is float32, rounded to the
    # compute dtype once); Qwen rounds them to the compute dtype first. The same in float32.
    float32_weights: bool = False
    shared_d_ff: int = 0  # Qwen2-MoE: the shared expert's intermediate size (every token, sigmoid-gated); 0: none

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} exceeds num_experts {self.num_experts}")
        if not self.layers or list(self.layers) != sorted(set(self.layers)) or min(self.layers) < 0:
            raise ValueError(f"layers must be distinct layer indices in order, got {self.layers}")
        if self.shared_d_ff < 0:
            raise ValueError(f"shared_d_ff must be >= 0, got {self.shared_d_ff}")


@dataclass(frozen=True)
class LlamaFamilyConfig:
    # Names shared with TransformerConfig (tinylm's) mean the same thing there.
    architecture: str  # architectures[0], one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    num_layers: int
    d_model: int  # hidden_size
    num_heads: int
    num_kv_heads: int
    head_size: int  # head_dim; not always d_model // num_heads
    d_ff: int  # intermediate_size
    max_position_embeddings: int
    max_seq_len: int  # the longest sequence this config was checked for (sliding window); <= max_position_embeddings
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-6
    qkv_bias: bool = False  # Qwen2: q, k and v projections carry a bias; o does not
    # q and k pass an RMSNorm (their own weights) after the projection and before RoPE: over each
    # head (QK_NORM_PER_HEAD: Qwen3) or over the whole projection (QK_NORM_FULL: OLMo 2); "": none.
    qk_norm: str = ""
    # Where each branch (attention, MLP) is normalized: its input (pre_norms: Llama's input_layernorm
    # and post_attention_layernorm), its output before the residual add (post_norms: OLMo 2's
    # post_attention_layernorm and post_feedforward_layernorm), or both (Gemma 2/3's four norms).
    pre_norms: bool = True
    post_norms: bool = False
    # Gemma: every RMSNorm weighs by (1 + w), in float32 before the cast back (Llama casts, then weighs).
    norm_plus_one: bool = False
    activation: str = "silu"  # the MLP gate's: "silu", or Gemma's "gelu_pytorch_tanh"
    embedding_normalizer: bool = False  # Gemma: embeddings times sqrt(d_model), rounded to the compute dtype
    # Phi-3: the checkpoint stores q/k/v as one qkv_proj and gate/up as one gate_up_proj (the
    # layout the model keeps them in), not five matrices.
    fused_projections: bool = False
    # Granite scales the embeddings, each residual branch (attention's and the MLP's) and the logits
    # (divided), and replaces attention's 1 / sqrt(head_size); 1.0 and None elsewhere.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    nope_layers: tuple[int, ...] = ()  # SmolLM3: the layers whose q and k are not rotated (NoPE)
    # Each layer's sliding window in tokens (a query sees itself and the window - 1 keys before it), 0
    # for full attention; () when no layer slides. A window of max_seq_len or more is stored as 0.
    layer_windows: tuple[int, ...] = ()
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' own (unscaled) RoPE base
    attention_softcap: float = 0.0  # Gemma 2: scores become c * tanh(score / c); 0 = none
    final_logit_softcap: float = 0.0  # Gemma 2: logits likewise
    tie_word_embeddings: bool = False  # the LM head is the embedding matrix (no lm_head.weight stored)
    storage_dtype: str | None = None  # what config.json declares the weights are stored as, if it says
    # Gemma3ForConditionalGeneration: the checkpoint is the language model's tensors under a prefix,
    # beside a vision tower and projector that are stored but never loaded (text prompts only).
    multimodal: bool = False
    experts: ExpertsConfig | None = None  # Mixtral, Qwen2-MoE, Qwen3-MoE: the layers whose MLP is routed experts
    # A quantized checkpoint (quantization_config): its Linear weights are stored as float8 with scales
    # (FP8) or packed integers with scales and zeros (AWQ, GPTQ), and dequantized at load to the compute
    # dtype; the model itself is the same. None: unquantized.
    quantization: Quantization | None = None
    # A base model's checkpoint (Qwen2Model, ...): no LM head (it serves embeddings only), and tensor
    # names without the `model.` prefix.
    base_model: bool = False
    # Served as an embedding model (the manifest's generator.embedding): its logits are never asked for,
    # so a *ForCausalLM checkpoint's untied LM head is neither allocated nor loaded (its bytes are still
    # hashed with its file). Not config.json's to say: the caller sets it (read_config's embedding_only).
    embedding_only: bool = False

    @property
    def holds_lm_head(self) -> bool:
        """Whether the model holds an LM head of its own: not when it is the embedding matrix (tied), the
        checkpoint has none (a base model) or it would never be used (an embedding model)."""
        return not (self.tie_word_embeddings or self.base_model or self.embedding_only)

    def has_experts(self, layer: int) -> bool:
        """Whether the layer's MLP is a mixture of experts (else the dense gated MLP of d_ff)."""
        return self.experts is not None and layer in self.experts.layers

    @property
    def attention_scale(self) -> float:
        """What q·k is multiplied by before the softmax."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return 1.0 / math.sqrt(self.head_size)

    def window_of(self, layer: int) -> int:
        """The layer's sliding window in tokens, 0 for full attention."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_size", "d_ff",
                     "max_position_embeddings", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_size % 2:
            raise ValueError(f"head_size {self.head_size} must be even for rotary embeddings")
        if self.layer_windows and (len(self.layer_windows) != self.num_layers or min(self.layer_windows) < 0):
            raise ValueError(f"layer_windows must hold {self.num_layers} windows >= 0, got {self.layer_windows}")
        if not (self.pre_norms or self.post_norms):
            raise ValueError("a branch is normalized on its input, its output or both")
        if self.max_seq_len > self.max_position_embeddings:
            raise ValueError(
                f"max_seq_len {self.max_seq_len} exceeds max_position_embeddings {self.max_position_embeddings}"
            )
        if self.experts is not None and max(self.experts.layers) >= self.num_layers:
            raise ValueError(f"expert layers {self.experts.layers} reach past the {self.num_layers} layers")

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], *, max_seq_len: int | None = None,
                file: str = "config.json") -> LlamaFamilyConfig:
        """Parses a `config.json` dict; `max_seq_len` (default max_position_embeddings) is the longest
        sequence the caller will run, which decides whether a sliding window matters. CheckpointError
        names the field of anything unsupported or malformed."""
        parser = _Parser(raw, file)
        architecture = parser.architecture()
        defaults = _TRAITS[architecture].text_config_defaults
        if defaults is not None:
            parser = parser.text_config(defaults)
        return parser.config(architecture, max_seq_len)


class _Parser:
    """Reads one config object: config.json, or its text_config (`prefix` "text_config.", inside
    `outer`, which may hold what the whole checkpoint shares: its dtype, its quantization)."""

    def __init__(self, raw: Mapping[str, Any], file: str, prefix: str = "", outer: _Parser | None = None) -> None:
        if not isinstance(raw, Mapping):
            raise CheckpointError(file, "(top level)", f"must be a JSON object, got {type(raw).__name__}")
        self.raw = raw
        self.file = file
        self.prefix = prefix
        self.outer = outer

    def fail(self, field: str, problem: str) -> CheckpointError:
        return CheckpointError(self.file, self.prefix + field, problem)

    def text_config(self, defaults: Mapping[str, Any]) -> _Parser:
        """The language model's config inside a vision + text config, its absent keys as `defaults`.
        transformers 4 ties the head by text_config's tie_word_embeddings, 5 by the top level's (and
        writes both): a config where they differ is refused."""
        text = self.raw.get("text_config")
        if not isinstance(text, Mapping):
            raise self.fail("text_config", f"must be an object (the language model's config), got {text!r}")
        parser = _Parser({**defaults, **text}, self.file, "text_config.", outer=self)
        tied = parser.boolean("tie_word_embeddings", default=True)
        if self.raw.get("tie_word_embeddings", tied) != tied:
            raise self.fail("tie_word_embeddings", f"{self.raw['tie_word_embeddings']!r}, but "
                            f"text_config.tie_word_embeddings is {tied!r}: transformers 4 and 5 would read "
                            "this checkpoint differently")
        return parser

    def config(self, architecture: str, max_seq_len: int | None) -> LlamaFamilyConfig:
        traits = _TRAITS[architecture]
        quantization = self.quantization()
        activation = self.activation(traits)
        d_model = self.positive_int("hidden_size")
        num_heads = self.positive_int("num_attention_heads")
        num_kv_heads = self.positive_int("num_key_value_heads", default=num_heads)
        if num_heads % num_kv_heads:
            raise self.fail("num_key_value_heads", f"{num_kv_heads} does not divide num_attention_heads {num_heads}")
        if self.raw.get("head_dim") is None and d_model % num_heads:
            raise self.fail("hidden_size", f"{d_model} is not divisible by num_attention_heads {num_heads} "
                            "and head_dim is not given")
        head_size = self.positive_int("head_dim", default=d_model // num_heads)
        if head_size % 2:
            raise self.fail("head_dim", f"{head_size} must be even for rotary embeddings")
        max_positions = self.positive_int("max_position_embeddings")
        seq_len = max_positions if max_seq_len is None else max_seq_len
        if not 1 <= seq_len <= max_positions:
            raise self.fail("max_position_embeddings", f"max_seq_len {seq_len} must be between 1 and "
                            f"max_position_embeddings {max_positions}")
        rope_theta, rope_scaling = self.rope(traits.default_rope_theta)
        self.check_biases(architecture)
        num_layers = self.num_layers()
        experts = self.experts(traits, num_layers)
        return LlamaFamilyConfig(
            architecture=architecture,
            vocab_size=self.positive_int("vocab_size"),
            num_layers=num_layers,
            d_model=d_model,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            d_ff=self.positive_int("intermediate_size"),
            max_position_embeddings=max_positions,
            max_seq_len=seq_len,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            norm_eps=self.positive_float("rms_norm_eps", default=1e-6),
            qkv_bias=traits.qkv_bias,
            qk_norm=traits.qk_norm,
            pre_norms=traits.pre_norms,
            post_norms=traits.post_norms,
            norm_plus_one=traits.gemma,
            activation=activation,
            embedding_normalizer=traits.gemma,
            fused_projections=traits.fused_projections,
            **self.granite_scalings(architecture),
            **self.gemma_scalings(traits),
            nope_layers=self.nope_layers(architecture),
            layer_windows=self.layer_windows(traits, num_layers, seq_len),
            local_rope_theta=self.local_rope_theta(traits),
            tie_word_embeddings=self.boolean("tie_word_embeddings", default=traits.tied_by_default),
            storage_dtype=self.storage_dtype(),
            multimodal=traits.text_config_defaults is not None,
            experts=experts,
            quantization=quantization,
            base_model=traits.base_model,
            embedding_only=False,  # the task, not config.json, decides (read_config's embedding_only)
        )

    def experts(self, traits: _Traits, num_layers: int) -> ExpertsConfig | None:
        """The mixture of experts as transformers builds it from the config; None for a dense
        architecture, or a Qwen MoE config whose every layer is dense."""
        if not traits.experts:
            return None
        num_experts = self.num_experts(traits)
        if traits.experts == EXPERTS_MIXTRAL:
            return ExpertsConfig(num_experts=num_experts, top_k=self.top_k(num_experts),
                                 d_ff=self.positive_int("intermediate_size"), layers=tuple(range(num_layers)),
                                 renormalize=True, float32_weights=True)
        if self.boolean("use_sliding_window", default=False):
            # transformers' Qwen MoE layers would slide (Qwen3-MoE every layer, Qwen2-MoE by its own
            # pattern); no released Qwen MoE checkpoint sets it.
            raise self.fail("use_sliding_window", "true is not supported for a Qwen mixture of experts; "
                            "supported: false")
        if traits.qkv_bias and not self.boolean("qkv_bias", default=True):  # Qwen2-MoE's switch (transformers 5)
            raise self.fail("qkv_bias", "false is not supported; supported: true (every released Qwen2-MoE's)")
        step = self.positive_int("decoder_sparse_step", default=1)
        dense = self.layer_list("mlp_only_layers", num_layers)
        layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        if not layers:
            return None
        return ExpertsConfig(
            num_experts=num_experts, top_k=self.top_k(num_experts), d_ff=self.positive_int("moe_intermediate_size"),
            layers=layers, renormalize=self.boolean("norm_topk_prob", default=False),
            shared_d_ff=self.positive_int("shared_expert_intermediate_size") if traits.shared_expert else 0)

    def num_experts(self, traits: _Traits) -> int:
        """num_experts (Qwen's released configs) or num_local_experts (Mixtral's, and what transformers
        5 writes for Qwen3-MoE): one of them, or both saying the same."""
        said = {name: self.raw[name] for name in ("num_experts", "num_local_experts") if self.raw.get(name) is not None}
        if len(set(map(repr, said.values()))) > 1:
            raise self.fail("num_local_experts", f"{said['num_local_experts']!r}, but num_experts is "
                            f"{said['num_experts']!r}: one number of experts")
        name = next(iter(said), "num_local_experts" if traits.experts == EXPERTS_MIXTRAL else "num_experts")
        value = self.positive_int(name)
        if value > MAX_EXPERTS:
            raise self.fail(name, f"{value} is more than {MAX_EXPERTS}; no supported model has as many")
        return value

    def top_k(self, num_experts: int) -> int:
        top_k = self.positive_int("num_experts_per_tok")
        if top_k > num_experts:
            raise self.fail("num_experts_per_tok", f"{top_k} exceeds the {num_experts} experts")
        return top_k

    def layer_list(self, name: str, num_layers: int) -> set[int]:
        """A list of layer indices (null or absent: none)."""
        value = self.raw.get(name)
        if value is None:
            return set()
        if not isinstance(value, list) or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers
                                               for i in value):
            raise self.fail(name, f"must be a list of layer indices below num_hidden_layers {num_layers}, "
                            f"got {value!r}")
        return set(value)

    def quantization(self) -> Quantization | None:
        """quantization_config: an FP8, AWQ or GPTQ scheme (quantization_config), or None for unquantized weights. A vision +
        text config's is read from its top level (where transformers writes it) unless text_config has one."""
        if self.raw.get("quantization_config") is None and self.outer is not None:
            return self.outer.quantization()
        return read_quantization(self.raw.get("quantization_config"), lambda field, problem: self.fail(
            f"quantization_config.{field}" if field else "quantization_config", problem))

    def architecture(self) -> str:
        architectures = self.raw.get("architectures")
        if not isinstance(architectures, list) or len(architectures) != 1:
            raise self.fail("architectures", f"must be a list of one architecture, got {architectures!r}; "
                            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        name = architectures[0]
        if name not in SUPPORTED_ARCHITECTURES:
            raise self.fail("architectures[0]", f"{name!r} is not supported; supported: "
                            f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        return str(name)

    def rope(self, default_theta: float) -> tuple[float, RopeScaling | None]:
        # transformers 5 writes rope_parameters (theta inside); 4 writes rope_theta beside rope_scaling.
        key = "rope_parameters" if self.raw.get("rope_parameters") is not None else "rope_scaling"
        params = self.raw.get(key)
        if _per_layer_type(params):  # Gemma 3's (transformers 5): the full-attention layers' are the model's
            key, params = f"{key}.full_attention", params.get("full_attention")
        # RoPE over part of each head (Phi-4-mini, GLM) is not implemented, wherever the config says it.
        field, partial = "partial_rotary_factor", self.raw.get("partial_rotary_factor")
        if isinstance(params, Mapping) and params.get("partial_rotary_factor") is not None:
            field, partial = f"{key}.partial_rotary_factor", params["partial_rotary_factor"]
        if partial is not None and not (_is_number(partial) and partial == 1.0):
            raise self.fail(field, f"{partial!r} is not supported; supported: 1.0")
        if params is None:
            return self.positive_float("rope_theta", default=default_theta), None
        if not isinstance(params, Mapping):
            raise self.fail(key, f"must be an object or null, got {params!r}")
        type_key = "rope_type" if "rope_type" in params else "type"
        rope_type = params.get(type_key, "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise self.fail(f"{key}.{type_key}", f"{rope_type!r} is not supported; supported: "
                            f"{', '.join(SUPPORTED_ROPE_TYPES)}")
        theta = params.get("rope_theta", self.raw.get("rope_theta", default_theta))
        if not _is_number(theta) or not theta > 0:
            raise self.fail(f"{key}.rope_theta", f"must be a number > 0, got {theta!r}")
        if rope_type == "default":
            return float(theta), None
        if rope_type == "linear":
            return float(theta), LinearRopeScaling(self.rope_number(key, params, "factor"))
        if rope_type == "yarn":
            return float(theta), self.yarn_scaling(key, params)
        return float(theta), self.llama3_scaling(key, params)

    def rope_number(self, key: str, params: Mapping[str, Any], name: str,
                    default: float | None = None) -> float:
        value = params.get(name)
        if value is None:
            value = default
        if not _is_number(value) or not value > 0 or not math.isfinite(value):
            raise self.fail(f"{key}.{name}", f"needs a finite number > 0, got {params.get(name)!r}")
        return float(value)

    def yarn_scaling(self, key: str, params: Mapping[str, Any]) -> YarnRopeScaling:
        # transformers' reading: original_max_position_embeddings from the scaling, else the config's
        # top level (Phi-3 keeps it there), else max_position_embeddings; a missing factor is their ratio.
        max_positions = self.positive_int("max_position_embeddings")
        original = params.get("original_max_position_embeddings",
                               self.raw.get("original_max_position_embeddings", max_positions))
        if not _is_number(original) or not original > 0 or not float(original).is_integer():
            raise self.fail(f"{key}.original_max_position_embeddings", f"must be an integer > 0, got {original!r}")
        factor = self.rope_number(key, params, "factor", max_positions / original)
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
            if mscale and mscale_all_dim:
                attention_factor = _yarn_mscale(factor, self.rope_number(key, params, "mscale")) / _yarn_mscale(
                    factor, self.rope_number(key, params, "mscale_all_dim"))
            else:
                attention_factor = _yarn_mscale(factor)
        else:
            attention_factor = self.rope_number(key, params, "attention_factor")
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise self.fail(f"{key}.truncate", f"must be true or false, got {truncate!r}")
        # transformers reads a beta of 0 as unset too.
        beta_fast = self.rope_number(key, params, "beta_fast") if params.get("beta_fast") else 32.0
        beta_slow = self.rope_number(key, params, "beta_slow") if params.get("beta_slow") else 1.0
        return YarnRopeScaling(factor=factor, original_max_position_embeddings=int(original),
                               attention_factor=float(attention_factor), beta_fast=beta_fast, beta_slow=beta_slow,
                               truncate=truncate)

    def llama3_scaling(self, key: str, params: Mapping[str, Any]) -> Llama3RopeScaling:
        values: dict[str, float] = {}
        for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            value = params.get(name)
            if not _is_number(value) or not value > 0:
                raise self.fail(f"{key}.{name}", f"llama3 rope scaling needs a number > 0, got {value!r}")
            values[name] = float(value)
        if not values["high_freq_factor"] > values["low_freq_factor"]:
            raise self.fail(f"{key}.high_freq_factor", f"{values['high_freq_factor']} must exceed "
                            f"low_freq_factor {values['low_freq_factor']}")
        original = values["original_max_position_embeddings"]
        if not original.is_integer():
            raise self.fail(f"{key}.original_max_position_embeddings", f"must be an integer, got {original!r}")
        return Llama3RopeScaling(
            factor=values["factor"],
            low_freq_factor=values["low_freq_factor"],
            high_freq_factor=values["high_freq_factor"],
            original_max_position_embeddings=int(original),
        )

    def activation(self, traits: _Traits) -> str:
        # Gemma's modeling code reads hidden_activation (its configs carry hidden_act beside it).
        name, supported = ("hidden_activation", GEMMA_ACTIVATIONS) if traits.gemma else ("hidden_act",
                                                                                        SUPPORTED_ACTIVATIONS)
        value = self.raw.get(name)
        if value is None:
            value = supported[0]
        if value not in supported:
            raise self.fail(name, f"{value!r} is not supported; supported: {', '.join(supported)}")
        return str(value)

    def gemma_scalings(self, traits: _Traits) -> dict[str, float]:
        """Gemma's attention scale (query_pre_attn_scalar ** -0.5) and its two softcaps (null: none)."""
        if not traits.gemma:
            return {}
        if self.raw.get("use_bidirectional_attention"):
            raise self.fail("use_bidirectional_attention", "true is not supported (an embedding model); "
                            "supported: false")
        softcaps = {}
        for name, field in (("attn_logit_softcapping", "attention_softcap"),
                            ("final_logit_softcapping", "final_logit_softcap")):
            value = self.raw.get(name)
            softcaps[field] = 0.0 if value is None else self.positive_float(name, default=1.0)
        return {"attention_multiplier": self.positive_float("query_pre_attn_scalar", default=256.0) ** -0.5,
                **softcaps}

    def local_rope_theta(self, traits: _Traits) -> float | None:
        """Gemma 3's sliding layers' RoPE base: rope_parameters.sliding_attention (transformers 5, default
        RoPE only) or rope_local_base_freq (4); 10000 when neither says."""
        if not traits.local_rope:
            return None
        params = self.raw.get("rope_parameters")
        if _per_layer_type(params) and params.get("sliding_attention") is not None:
            local = params["sliding_attention"]
            field = "rope_parameters.sliding_attention"
            if not isinstance(local, Mapping):
                raise self.fail(field, f"must be an object, got {local!r}")
            rope_type = local.get("rope_type", local.get("type", "default"))
            if rope_type != "default":
                raise self.fail(f"{field}.rope_type", f"{rope_type!r} is not supported; supported: default")
            return self.rope_number(field, local, "rope_theta", 10000.0)
        return self.positive_float("rope_local_base_freq", default=10000.0)

    def granite_scalings(self, architecture: str) -> dict[str, float]:
        # Read for Granite only: transformers' other decoders ignore these keys, and so do we.
        if not _TRAITS[architecture].scalings:
            return {}
        return {name: self.positive_float(name, default=1.0) for name in (
            "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")}

    def nope_layers(self, architecture: str) -> tuple[int, ...]:
        """SmolLM3's layers without RoPE: no_rope_layers (1 rotates, 0 does not, one per layer), or
        by default every no_rope_layer_interval-th layer (transformers' default 4)."""
        if not _TRAITS[architecture].nope_layers:
            return ()
        num_layers = self.num_layers()
        flags = self.raw.get("no_rope_layers")
        if flags is None:
            interval = self.positive_int("no_rope_layer_interval", default=4)
            return tuple(i for i in range(num_layers) if (i + 1) % interval == 0)
        if not isinstance(flags, list) or len(flags) != num_layers or any(f not in (0, 1) or isinstance(f, bool)
                                                                           for f in flags):
            raise self.fail("no_rope_layers", f"must be a list of {num_layers} 0s and 1s (one per layer), "
                            f"got {flags!r}")
        return tuple(i for i, rotates in enumerate(flags) if not rotates)

    def check_biases(self, architecture: str) -> None:
        # Qwen2's q/k/v biases are fixed by its architecture; the others' configs may switch biases on,
        # which no released checkpoint of theirs does: refused rather than half-supported.
        for name in ("attention_bias", "mlp_bias"):
            if not _TRAITS[architecture].qkv_bias and self.boolean(name, default=False):
                raise self.fail(name, f"true is not supported for {architecture}; supported: false "
                                "(Qwen2ForCausalLM's q/k/v biases are)")

    def layer_windows(self, traits: _Traits, num_layers: int, max_seq_len: int) -> tuple[int, ...]:
        """Each layer's sliding window (0: full attention), as transformers reads the config: its
        layer_types when given (transformers 5 writes them); else Mistral and Phi-3 slide every layer,
        Qwen2, Qwen3 and SmolLM3 the layers from max_window_layers on when use_sliding_window is set,
        Gemma all but every sliding_window_pattern-th. A window of max_seq_len tokens or more never
        hides a key, so it is stored as 0; () when no layer slides."""
        sliding = self.sliding_layers(traits, num_layers)
        if not sliding:
            return ()
        window = self.raw.get("sliding_window")
        if window is None:
            return ()
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise self.fail("sliding_window", f"must be a positive int or null, got {window!r}")
        if window >= max_seq_len:
            return ()
        return tuple(window if i in sliding else 0 for i in range(num_layers))

    def sliding_layers(self, traits: _Traits, num_layers: int) -> set[int]:
        layer_types = self.raw.get("layer_types")
        if layer_types is not None:
            if not isinstance(layer_types, list) or len(layer_types) != num_layers or not set(layer_types) <= {
                    "full_attention", "sliding_attention"}:
                raise self.fail("layer_types", f"must be a list of {num_layers} 'full_attention' or "
                                f"'sliding_attention', got {layer_types!r}")
            return {i for i, kind in enumerate(layer_types) if kind == "sliding_attention"}
        if traits.window == WINDOW_ALWAYS:
            return set(range(num_layers))
        if traits.window == WINDOW_SWITCHED and self.boolean("use_sliding_window", default=False):
            return set(range(self.count("max_window_layers"), num_layers))
        if traits.window == WINDOW_PATTERN:
            pattern = self.positive_int("sliding_window_pattern", default=traits.window_pattern)
            return {i for i in range(num_layers) if (i + 1) % pattern}
        return set()

    def storage_dtype(self) -> str | None:
        key = "dtype" if self.raw.get("dtype") is not None else "torch_dtype"
        value = self.raw.get(key)
        if value is None:  # a text_config's may be said at the top level (transformers writes it there)
            return None if self.outer is None else self.outer.storage_dtype()
        if value not in SUPPORTED_STORAGE_DTYPES:
            raise self.fail(key, f"{value!r} is not supported; supported: {', '.join(SUPPORTED_STORAGE_DTYPES)}")
        return str(value)

    def num_layers(self) -> int:
        """num_hidden_layers, bounded: per-layer tables are built from it before any weight is read."""
        value = self.positive_int("num_hidden_layers")
        if value > MAX_LAYERS:
            raise self.fail("num_hidden_layers", f"{value} is more than {MAX_LAYERS}; no supported model has as many")
        return value

    def positive_int(self, name: str, *, default: int | None = None) -> int:
        value = self.raw.get(name)
        if value is None:
            if default is None:
                raise self.fail(name, "is required")
            return default
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise self.fail(name, f"must be a positive int, got {value!r}")
        return value

    def count(self, name: str) -> int:
        value = self.raw.get(name, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise self.fail(name, f"must be an int >= 0, got {value!r}")
        return value

    def positive_float(self, name: str, *, default: float) -> float:
        value = self.raw.get(name, default)
        if value is None:
            value = default
        if not _is_number(value) or not value > 0 or not math.isfinite(value):
            raise self.fail(name, f"must be a finite number > 0, got {value!r}")
        return float(value)

    def boolean(self, name: str, *, default: bool) -> bool:
        value = self.raw.get(name, default)
        if not isinstance(value, bool):
            raise self.fail(name, f"must be true or false, got {value!r}")
        return value


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _per_layer_type(params: object) -> TypeGuard[Mapping[str, Any]]:
    """Whether RoPE parameters are given per layer type (Gemma 3's rope_parameters in transformers 5)."""
    return isinstance(params, Mapping) and ("full_attention" in params or "sliding_attention" in params)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)
