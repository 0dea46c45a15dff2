"""Attention over gathered keys for the dense reference and the paged step's chunks: which keys a query
may see (causal, within a sliding window) and the softmax over them, with Gemma 2's score softcap.

The decode kernels (kernels.paged_attention) take the same window and softcap; this is their PyTorch
counterpart for many queries at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def visible_keys(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """`bool[n, num_keys]`: key j is visible to query i when it is not after it and, with a sliding
    window (> 0), fewer than `window` positions before it (transformers' `kv_idx > q_idx - window`)."""
    distance = query_pos[:, None] - key_pos[None, :]
    visible = distance >= 0
    if window:
        visible &= distance < window
    return visible


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, visible: torch.Tensor | None, scale: float,
              softcap: float = 0.0) -> torch.Tensor:
    """`softmax(cap(scale * q·k) | visible) · v` over `[B, heads, n, hs]` queries and `[B, kv_heads, keys, hs]`
    keys and values (grouped-query: each KV head serves its group of query heads); `visible` broadcasts
    to `[B, heads, n, keys]`, None for causal with queries ending at the last key. `softcap` c > 0 makes
    each score c * tanh(score / c) before the mask, as Gemma 2 computes (0: none, SDPA's fused path)."""
    if not softcap:
        if visible is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if visible is None:
        n, num_keys = q.shape[-2], k.shape[-2]
        positions = torch.arange(num_keys, device=q.device)
        visible = visible_keys(positions[num_keys - n:], positions, 0)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)
