"""Rotary position embeddings (RoPE): the cos and sin of a step's positions, and the rotation of q and k.

Shared by tinylm (transformer.py), the Llama family (llama_family.py) and the paged step (paged.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rotary:
    """RoPE's cos and sin for a step's token positions, `[..., T, 1, head_size // 2]`: computed once
    per forward and shared by every layer's q and k (they depend only on positions)."""

    cos: torch.Tensor
    sin: torch.Tensor
    # Gemma 3's sliding-window layers rotate by a RoPE of their own base; None where every layer shares one.
    local: Rotary | None = None


def rotary(positions: torch.Tensor, head_size: int, theta: float) -> Rotary:
    half = head_size // 2
    return rotary_from(positions, theta ** (-torch.arange(half, dtype=torch.float32, device=positions.device) / half))


def rotary_from(positions: torch.Tensor, inv_freq: torch.Tensor, factor: float = 1.0,
                local: Rotary | None = None) -> Rotary:
    """RoPE's cos and sin of `positions` at each pair's inverse frequency, times `factor` (YaRN's)."""
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [..., T, head_size // 2]
    cos, sin = angles.cos(), angles.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return Rotary(cos[..., None, :], sin[..., None, :], local)  # broadcast over heads


def apply_rope(x: torch.Tensor, rope: Rotary) -> torch.Tensor:
    """Rotate `x[..., T, heads, head_size]` by its positions' angles (rotate-half form)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * rope.cos - x2 * rope.sin, x2 * rope.cos + x1 * rope.sin), dim=-1)
