"""The dense causal forward of a decoder LM: the reference `paged_forward` is checked against.

One pass over the whole sequence with SDPA's causal mask, no KV cache. It runs any `PagedLM`
(tinylm's DecoderLM and the Llama family's LlamaFamilyLM), through the same pieces the paged
step runs (embed, each block's qkv / attn_out / mlp, rotary, logits), so the two differ only in
how attention finds its keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from services.worker.models.paged import PagedLM


def dense_forward(lm: PagedLM, input_ids: torch.Tensor) -> torch.Tensor:
    """`input_ids int64[B, T]` (positions 0..T-1) → logits `float32[B, T, vocab]`."""
    rope = lm.rotary(torch.arange(input_ids.shape[1], device=input_ids.device))
    x = lm.embed(input_ids)
    for layer in lm.blocks():
        q, k, v = layer.qkv(x, rope)
        # SDPA wants [B, heads, T, hs]; GQA by sharing each KV head across its query group.
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True,
            scale=lm.config.attention_scale,
        )
        x = x + layer.attn_out(attn.transpose(1, 2))
        x = x + layer.mlp(x)
    return lm.logits(x)
