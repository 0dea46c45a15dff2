"""A small decoder-only transformer (RMSNorm, RoPE, grouped-query attention, SwiGLU).

The layers expose their pieces (`qkv`, `attn_out`, `mlp`) so the same weights
run two ways: `DecoderLM.forward` is the dense full-sequence reference, and
`models.paged.paged_forward` runs one continuous-batching step over a paged KV
cache. Tests hold the two to the same greedy tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.models.dense import dense_forward
from services.worker.models.rope import Rotary, apply_rope, rotary


@dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int
    num_layers: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    d_ff: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_size % 2:
            raise ValueError(f"head_size {self.head_size} must be even for rotary embeddings")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError(f"rope_theta and norm_eps must be > 0, got {self.rope_theta}, {self.norm_eps}")

    @property
    def head_size(self) -> int:
        return self.d_model // self.num_heads

    @property
    def attention_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_size)

    @property
    def attention_softcap(self) -> float:
        return 0.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    # Not layer(x): nn.Module.__call__'s hook checks cost ~1.4 us a call, and a decode step makes ~40
    # of them (the layers below call their Linears and norms through this and `.forward`).
    return F.linear(x, layer.weight, layer.bias)


class DecoderBlock(nn.Module):
    window = 0  # full attention in every layer (paged.PagedBlock)

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        hs = config.head_size
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.wq = nn.Linear(config.d_model, config.num_heads * hs, bias=False)
        self.wk = nn.Linear(config.d_model, config.num_kv_heads * hs, bias=False)
        self.wv = nn.Linear(config.d_model, config.num_kv_heads * hs, bias=False)
        self.wo = nn.Linear(config.num_heads * hs, config.d_model, bias=False)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.w_gate = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.w_up = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.w_down = nn.Linear(config.d_ff, config.d_model, bias=False)

    def qkv(self, x: torch.Tensor, rope: Rotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed `x[..., T, d_model]` → q `[..., T, num_heads, hs]`, k and v `[..., T, num_kv_heads, hs]`, RoPE applied."""
        c = self.config
        h = self.attn_norm.forward(x)
        lead = h.shape[:-1]
        q = _linear(h, self.wq).view(*lead, c.num_heads, c.head_size)
        k = _linear(h, self.wk).view(*lead, c.num_kv_heads, c.head_size)
        v = _linear(h, self.wv).view(*lead, c.num_kv_heads, c.head_size)
        # q and k rotate by the same angles: one rotation over their heads side by side is half the
        # ops of two (element for element the same arithmetic).
        q, k = apply_rope(torch.cat((q, k), dim=-2), rope).split((c.num_heads, c.num_kv_heads), dim=-2)
        return q, k, v

    def attn_out(self, attn: torch.Tensor) -> torch.Tensor:
        """Attention output `[..., T, num_heads, hs]` → residual update `[..., T, d_model]`."""
        return _linear(attn.flatten(-2), self.wo)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mlp_norm.forward(x)
        return _linear(F.silu(_linear(h, self.w_gate)) * _linear(h, self.w_up), self.w_down)


class DecoderLM(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(DecoderBlock(config) for _ in range(config.num_layers))
        self.final_norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def blocks(self) -> Iterator[DecoderBlock]:
        """The decoder blocks, typed (ModuleList yields plain Modules)."""
        return iter(cast("Iterable[DecoderBlock]", self.layers))

    def rotary(self, positions: torch.Tensor) -> Rotary:
        return rotary(positions, self.config.head_size, self.config.rope_theta)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return _linear(self.final_norm.forward(hidden), self.lm_head)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Dense causal reference: `input_ids int64[B, T]` (positions 0..T-1) → logits `float32[B, T, vocab]`."""
        return dense_forward(self, input_ids)
