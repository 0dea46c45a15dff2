"""The dense causal forward of a decoder LM: the reference `paged_forward` is checked against.

One pass over the whole sequence with a causal mask (and each layer's sliding window), no KV cache. It runs any `PagedLM`
(tinylm's DecoderLM and the Llama family's LlamaFamilyLM), through the same pieces the paged
step runs (embed, each block's qkv / attn_out / mlp, rotary, logits), so the two differ only in
how attention finds its keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from services.worker.models.attention import attention, visible_keys

if TYPE_CHECKING:
    from services.worker.models.paged import PagedLM


def dense_forward(lm: PagedLM, input_ids: torch.Tensor) -> torch.Tensor:
    """`input_ids int64[B, T]` (positions 0..T-1) → logits `float32[B, T, vocab]`."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    rope = lm.rotary(positions)
    x = lm.embed(input_ids)
    for layer in lm.blocks():
        q, k, v = layer.qkv(x, rope)
        visible = visible_keys(positions, positions, layer.window) if layer.window else None
        # Attention wants [B, heads, T, hs]; GQA by sharing each KV head across its query group.
        attn = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), visible=visible,
                         scale=lm.config.attention_scale, softcap=lm.config.attention_softcap)
        x = x + layer.attn_out(attn.transpose(1, 2))
        x = x + layer.mlp(x)
    return lm.logits(x)
