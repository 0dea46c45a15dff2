"""The Llama-family decoder (Llama, Qwen2, Qwen3, Mistral, Phi-3, Granite, SmolLM3, OLMo 2, Gemma 2 and 3,
and the mixtures of experts Mixtral, Qwen2-MoE and Qwen3-MoE): one module, parametrized by
`LlamaFamilyConfig`.

It has the shape `paged_forward` runs (`embed`, `rotary`, `blocks()` with `qkv`,
`attn_out` and `mlp`, `logits`), so a step over the worker's paged KV cache is
the same code and the same kernels as tinylm's; `forward` is the dense
full-sequence reference.

Weights live in the compute dtype (float32, float16 or bfloat16). Attention
runs in float32 whatever it is: q, k and v leave `qkv` as float32 because the
KV cache and the kernels are float32, and `attn_out` casts back. RMSNorm
normalizes in float32 and casts before scaling by its weight, as the
checkpoints were trained. Logits are float32.

Parameters are fused the way a serving engine wants them: one q/k/v matrix
(rows q, then k, then v) and one gate/up matrix, so a layer makes two matmuls
where the checkpoint stores five. A layer whose MLP is a mixture of experts
holds them stacked (`experts.MixtureOfExperts`) in place of the dense MLP.
`llama_weights` maps checkpoint tensors onto them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.models.dense import dense_forward
from services.worker.models.experts import MixtureOfExperts
from services.worker.models.llama_config import QK_NORM_FULL, QK_NORM_PER_HEAD, LlamaFamilyConfig
from services.worker.models.rope import Rotary, apply_rope, rotary_from
from services.worker.models.rope_scaling import rope_attention_factor, rope_inv_freq

if TYPE_CHECKING:
    from services.worker.models.lora import LayerLora

COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialized: every parameter is overwritten by the checkpoint, and random init of a
    # vocabulary-sized matrix costs more than reading it.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, plus_one: bool = False) -> torch.Tensor:
    """Normalizes in float32 and casts back before the weight, as the family's checkpoints were trained;
    `plus_one` (Gemma) weighs by 1 + w in float32 and casts after."""
    x32 = x.float()
    normalized = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if plus_one:
        return (normalized * (1.0 + weight.float())).to(x.dtype)
    return normalized.to(x.dtype) * weight


_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _scaled(x: torch.Tensor, multiplier: float) -> torch.Tensor:
    return x if multiplier == 1.0 else x * multiplier


class LlamaFamilyBlock(nn.Module):
    def __init__(self, config: LlamaFamilyConfig, dtype: torch.dtype, device: torch.device, index: int) -> None:
        super().__init__()
        self.config = config
        self.uses_rope = index not in config.nope_layers
        self.window = config.window_of(index)  # sliding window in tokens; 0: full attention
        # Gemma 3's sliding layers rotate by their own RoPE base (Rotary.local).
        self.uses_local_rope = bool(self.window) and config.local_rope_theta is not None
        c = config
        self._act = _ACTIVATIONS[c.activation]
        q_size, kv_size = c.num_heads * c.head_size, c.num_kv_heads * c.head_size
        # Each branch's norms (llama_config's pre_norms / post_norms): on its input, its output, or both.
        self.attn_norm = _empty(c.d_model, dtype=dtype, device=device) if c.pre_norms else None
        self.attn_post_norm = _empty(c.d_model, dtype=dtype, device=device) if c.post_norms else None
        self.qkv_weight = _empty(q_size + 2 * kv_size, c.d_model, dtype=dtype, device=device)
        self.qkv_bias = _empty(q_size + 2 * kv_size, dtype=dtype, device=device) if c.qkv_bias else None
        per_head = c.qk_norm == QK_NORM_PER_HEAD
        self.q_norm = _empty(c.head_size if per_head else q_size, dtype=dtype, device=device) if c.qk_norm else None
        self.k_norm = _empty(c.head_size if per_head else kv_size, dtype=dtype, device=device) if c.qk_norm else None
        self.o_weight = _empty(c.d_model, q_size, dtype=dtype, device=device)
        self.mlp_norm = _empty(c.d_model, dtype=dtype, device=device) if c.pre_norms else None
        self.mlp_post_norm = _empty(c.d_model, dtype=dtype, device=device) if c.post_norms else None
        # The MLP: routed experts (Mixtral's layers, Qwen MoE's sparse ones), or the dense gated MLP.
        self.experts = (MixtureOfExperts(c.experts, c.d_model, self._act, dtype, device)
                        if c.experts is not None and c.has_experts(index) else None)
        dense = self.experts is None
        self.gate_up_weight = _empty(2 * c.d_ff, c.d_model, dtype=dtype, device=device) if dense else None
        self.down_weight = _empty(c.d_model, c.d_ff, dtype=dtype, device=device) if dense else None
        self._split = (q_size, kv_size, kv_size)
        # LoRA adapters on this layer's linears (models/lora.LoraSet installs it); None: none loaded,
        # and the forward is exactly the base model's.
        self.lora: LayerLora | None = None

    def _norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        if weight is None:
            return x
        return rms_norm(x, weight, self.config.norm_eps, plus_one=self.config.norm_plus_one)

    def qkv(self, x: torch.Tensor, rope: Rotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`x[..., T, d_model]` → float32 q `[..., T, num_heads, hs]`, k and v `[..., T, num_kv_heads, hs]`, RoPE applied."""
        c = self.config
        h = self._norm(x, self.attn_norm)
        lead = h.shape[:-1]
        qkv = F.linear(h, self.qkv_weight, self.qkv_bias)
        if self.lora is not None:
            qkv = self.lora.add("qkv", h, qkv)
        q, k, v = qkv.split(self._split, dim=-1)
        # q/k norms run in the compute dtype, as the checkpoint was trained; RoPE and attention in float32.
        if c.qk_norm == QK_NORM_FULL:
            q, k = self._norm(q, self.q_norm), self._norm(k, self.k_norm)
        q, k = q.view(*lead, c.num_heads, c.head_size), k.view(*lead, c.num_kv_heads, c.head_size)
        if c.qk_norm == QK_NORM_PER_HEAD:
            q, k = self._norm(q, self.q_norm), self._norm(k, self.k_norm)
        v = v.float().reshape(*lead, c.num_kv_heads, c.head_size)
        if not self.uses_rope:  # SmolLM3's NoPE layers: positions reach them only through the others
            return q.float(), k.float(), v
        if self.uses_local_rope and rope.local is not None:
            rope = rope.local
        # q and k rotate by the same angles: one rotation over their heads side by side.
        qk = torch.cat((q.float(), k.float()), dim=-2)
        q, k = apply_rope(qk, rope).split((c.num_heads, c.num_kv_heads), dim=-2)
        return q, k, v

    def attn_out(self, attn: torch.Tensor) -> torch.Tensor:
        """Float32 attention output `[..., T, num_heads, hs]` → residual update `[..., T, d_model]` (compute dtype)."""
        flat = attn.flatten(-2).to(self.o_weight.dtype)
        out = F.linear(flat, self.o_weight)
        if self.lora is not None:
            out = self.lora.add("o", flat, out)
        return _scaled(self._norm(out, self.attn_post_norm), self.config.residual_multiplier)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = self._norm(x, self.mlp_norm)
        if self.experts is not None:
            out = self.experts.forward(h)
        else:
            assert self.gate_up_weight is not None and self.down_weight is not None  # built with no experts
            gate_up = F.linear(h, self.gate_up_weight)
            if self.lora is not None:
                gate_up = self.lora.add("gate_up", h, gate_up)
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = self._act(gate) * up
            out = F.linear(hidden, self.down_weight)
            if self.lora is not None:
                out = self.lora.add("down", hidden, out)
        return _scaled(self._norm(out, self.mlp_post_norm), self.config.residual_multiplier)


class LlamaFamilyLM(nn.Module):
    """Built empty (uninitialized parameters); `llama_weights.load_llama_family` fills it from a checkpoint."""

    def __init__(self, config: LlamaFamilyConfig, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        super().__init__()
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute dtype must be one of {', '.join(map(str, COMPUTE_DTYPES))}, got {dtype}")
        device = torch.device(device)
        self.config = config
        self.embed_weight = _empty(config.vocab_size, config.d_model, dtype=dtype, device=device)
        self.layers = nn.ModuleList(LlamaFamilyBlock(config, dtype, device, i) for i in range(config.num_layers))
        self.final_norm = _empty(config.d_model, dtype=dtype, device=device)
        self.lm_head_weight = (
            _empty(config.vocab_size, config.d_model, dtype=dtype, device=device) if config.holds_lm_head else None
        )
        self.register_buffer("inv_freq", rope_inv_freq(config, device), persistent=False)
        self.register_buffer("local_inv_freq", None if config.local_rope_theta is None else
                             rope_inv_freq(config, device, theta=config.local_rope_theta, scaled=False),
                             persistent=False)
        self._rope_attention_factor = rope_attention_factor(config)
        # Gemma multiplies embeddings by sqrt(d_model) rounded to the weights' dtype, as transformers does.
        self._embed_scale = (float(torch.tensor(config.d_model ** 0.5).to(dtype))
                             if config.embedding_normalizer else config.embedding_multiplier)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return _scaled(F.embedding(token_ids, self.embed_weight), self._embed_scale)

    def blocks(self) -> Iterator[LlamaFamilyBlock]:
        return iter(cast("Iterable[LlamaFamilyBlock]", self.layers))

    def rotary(self, positions: torch.Tensor) -> Rotary:
        local = None
        if self.local_inv_freq is not None:
            local = rotary_from(positions, cast(torch.Tensor, self.local_inv_freq))
        return rotary_from(positions, cast(torch.Tensor, self.inv_freq), self._rope_attention_factor, local)

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last layer's output after the final norm, float32: transformers' last_hidden_state, which
        an embedding model pools."""
        c = self.config
        return rms_norm(hidden, self.final_norm, c.norm_eps, plus_one=c.norm_plus_one).float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        c = self.config
        # A base model or an embedding model holds no head (it serves embeddings only, final_hidden, and
        # never asks for logits); the embedding matrix stands in for it.
        head = self.embed_weight if self.lm_head_weight is None else self.lm_head_weight
        logits = F.linear(rms_norm(hidden, self.final_norm, c.norm_eps, plus_one=c.norm_plus_one), head)
        if c.logits_scaling != 1.0:
            logits = logits / c.logits_scaling
        if c.final_logit_softcap:  # Gemma 2: in the compute dtype, as transformers caps them
            logits = torch.tanh(logits / c.final_logit_softcap) * c.final_logit_softcap
        return logits.float()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Dense causal reference: `input_ids int64[B, T]` (positions 0..T-1) → logits `float32[B, T, vocab]`."""
        return dense_forward(self, input_ids)
