"""The Llama-family decoder (Llama, Qwen2, Qwen3, Mistral, Phi-3, Granite, SmolLM3, OLMo 2): one module,
parametrized by `LlamaFamilyConfig`.

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
where the checkpoint stores five. `llama_weights` maps checkpoint tensors onto
them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.models.dense import dense_forward
from services.worker.models.llama_config import QK_NORM_FULL, QK_NORM_PER_HEAD, LlamaFamilyConfig
from services.worker.models.rope import Rotary, apply_rope
from services.worker.models.rope_scaling import rope_attention_factor, rope_inv_freq

COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialized: every parameter is overwritten by the checkpoint, and random init of a
    # vocabulary-sized matrix costs more than reading it.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalizes in float32 and casts back before the weight, as the family's checkpoints were trained."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _scaled(x: torch.Tensor, multiplier: float) -> torch.Tensor:
    return x if multiplier == 1.0 else x * multiplier


class LlamaFamilyBlock(nn.Module):
    def __init__(self, config: LlamaFamilyConfig, dtype: torch.dtype, device: torch.device, index: int) -> None:
        super().__init__()
        self.config = config
        self.uses_rope = index not in config.nope_layers
        c = config
        q_size, kv_size = c.num_heads * c.head_size, c.num_kv_heads * c.head_size
        # The attention branch's norm and the MLP branch's: on their inputs (Llama's input_layernorm and
        # post_attention_layernorm) or, with post_norms, on their outputs (OLMo 2's post_attention_layernorm
        # and post_feedforward_layernorm).
        self.attn_norm = _empty(c.d_model, dtype=dtype, device=device)
        self.qkv_weight = _empty(q_size + 2 * kv_size, c.d_model, dtype=dtype, device=device)
        self.qkv_bias = _empty(q_size + 2 * kv_size, dtype=dtype, device=device) if c.qkv_bias else None
        per_head = c.qk_norm == QK_NORM_PER_HEAD
        self.q_norm = _empty(c.head_size if per_head else q_size, dtype=dtype, device=device) if c.qk_norm else None
        self.k_norm = _empty(c.head_size if per_head else kv_size, dtype=dtype, device=device) if c.qk_norm else None
        self.o_weight = _empty(c.d_model, q_size, dtype=dtype, device=device)
        self.mlp_norm = _empty(c.d_model, dtype=dtype, device=device)
        self.gate_up_weight = _empty(2 * c.d_ff, c.d_model, dtype=dtype, device=device)
        self.down_weight = _empty(c.d_model, c.d_ff, dtype=dtype, device=device)
        self._split = (q_size, kv_size, kv_size)

    def qkv(self, x: torch.Tensor, rope: Rotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`x[..., T, d_model]` → float32 q `[..., T, num_heads, hs]`, k and v `[..., T, num_kv_heads, hs]`, RoPE applied."""
        c = self.config
        h = x if c.post_norms else rms_norm(x, self.attn_norm, c.norm_eps)
        lead = h.shape[:-1]
        qkv = F.linear(h, self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.split(self._split, dim=-1)
        # q/k norms run in the compute dtype, as the checkpoint was trained; RoPE and attention in float32.
        if c.qk_norm == QK_NORM_FULL and self.q_norm is not None and self.k_norm is not None:
            q, k = rms_norm(q, self.q_norm, c.norm_eps), rms_norm(k, self.k_norm, c.norm_eps)
        q, k = q.view(*lead, c.num_heads, c.head_size), k.view(*lead, c.num_kv_heads, c.head_size)
        if c.qk_norm == QK_NORM_PER_HEAD and self.q_norm is not None and self.k_norm is not None:
            q, k = rms_norm(q, self.q_norm, c.norm_eps), rms_norm(k, self.k_norm, c.norm_eps)
        v = v.float().reshape(*lead, c.num_kv_heads, c.head_size)
        if not self.uses_rope:  # SmolLM3's NoPE layers: positions reach them only through the others
            return q.float(), k.float(), v
        # q and k rotate by the same angles: one rotation over their heads side by side.
        qk = torch.cat((q.float(), k.float()), dim=-2)
        q, k = apply_rope(qk, rope).split((c.num_heads, c.num_kv_heads), dim=-2)
        return q, k, v

    def attn_out(self, attn: torch.Tensor) -> torch.Tensor:
        """Float32 attention output `[..., T, num_heads, hs]` → residual update `[..., T, d_model]` (compute dtype)."""
        out = F.linear(attn.flatten(-2).to(self.o_weight.dtype), self.o_weight)
        if self.config.post_norms:
            out = rms_norm(out, self.attn_norm, self.config.norm_eps)
        return _scaled(out, self.config.residual_multiplier)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        h = x if c.post_norms else rms_norm(x, self.mlp_norm, c.norm_eps)
        gate, up = F.linear(h, self.gate_up_weight).chunk(2, dim=-1)
        out = F.linear(F.silu(gate) * up, self.down_weight)
        if c.post_norms:
            out = rms_norm(out, self.mlp_norm, c.norm_eps)
        return _scaled(out, c.residual_multiplier)


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
            None if config.tie_word_embeddings else _empty(config.vocab_size, config.d_model, dtype=dtype, device=device)
        )
        self.register_buffer("inv_freq", rope_inv_freq(config, device), persistent=False)
        self._rope_attention_factor = rope_attention_factor(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return _scaled(F.embedding(token_ids, self.embed_weight), self.config.embedding_multiplier)

    def blocks(self) -> Iterator[LlamaFamilyBlock]:
        return iter(cast("Iterable[LlamaFamilyBlock]", self.layers))

    def rotary(self, positions: torch.Tensor) -> Rotary:
        angles = positions.to(torch.float32)[..., None] * cast(torch.Tensor, self.inv_freq)  # [..., T, hs / 2]
        cos, sin = angles.cos(), angles.sin()
        if self._rope_attention_factor != 1.0:
            cos, sin = cos * self._rope_attention_factor, sin * self._rope_attention_factor
        return Rotary(cos[..., None, :], sin[..., None, :])  # broadcast over heads

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_weight if self.lm_head_weight is None else self.lm_head_weight
        logits = F.linear(rms_norm(hidden, self.final_norm, self.config.norm_eps), head)
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        return logits.float()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Dense causal reference: `input_ids int64[B, T]` (positions 0..T-1) → logits `float32[B, T, vocab]`."""
        return dense_forward(self, input_ids)
