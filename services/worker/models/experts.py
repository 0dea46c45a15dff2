"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks each token's top-k
experts, and the token's update is their gated MLPs' outputs, weighted by the routing probabilities,
summed.

Routing follows transformers' order of operations for each family (`route`): router logits in the
compute dtype, a float32 softmax over all experts, the top k, divided by their sum where the config
says (Qwen's norm_topk_prob; Mixtral always, which is the softmax over the top-k logits computed
transformers' way), then rounded to the compute dtype (Qwen) or kept in float32 (Mixtral).

Experts are stacked per layer, as transformers 5 holds them (`gate_up float[num_experts, 2 * d_ff,
d_model]`, each expert's gate rows then its up rows; `down float[num_experts, d_model, d_ff]`), so
the forward is a few batched ops (`grouped_experts`, the shape of transformers 5's default experts
forward): the (token, choice) pairs are sorted by expert, each expert that any token chose runs once
over its rows, the rows are scaled by their weights, put back in token order and summed per token.

Eager only: how many rows each expert gets depends on the routing, which the host reads once a layer
(one synchronization), so a CUDA graph cannot record it; the worker serves these models without
decode graphs (services/worker/decode_graph_steps.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.models.llama_config import ExpertsConfig

Activation = Callable[[torch.Tensor], torch.Tensor]


def _uninitialized(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # As llama_family's parameters: every one is overwritten by the checkpoint.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def route(router_logits: torch.Tensor, top_k: int, *, renormalize: bool,
          float32_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`router_logits [num_tokens, num_experts]` (compute dtype) → each token's routing weights
    `[num_tokens, top_k]` (float32 with `float32_weights`, else the logits' dtype) and experts
    `int64[num_tokens, top_k]`, most probable first."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if float32_weights else weights.to(router_logits.dtype)), experts


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, act: Activation) -> torch.Tensor:
    """Each token's experts over `x [num_tokens, d_model]`, weighted and summed: `[num_tokens, d_model]`.

    `experts int64[num_tokens, top_k]` and `weights [num_tokens, top_k]` as `route` gives them; one
    gate/up and one down matmul per expert chosen at least once, over the rows that chose it. A
    token's weighted outputs (float32 with float32 weights) are summed with one rounding to the
    compute dtype, as transformers 5's default experts forward (grouped_mm) sums them."""
    num_tokens, top_k = experts.shape
    choices = experts.flatten()  # token-major: token t's choices are rows t * top_k ...
    order = torch.argsort(choices, stable=True)  # ... and here expert-major, token order within one
    rows = x[order // top_k]
    out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(torch.bincount(choices, minlength=gate_up.shape[0]).tolist()):
        if count:
            chosen = slice(start, start + count)
            gate, up = F.linear(rows[chosen], gate_up[expert]).chunk(2, dim=-1)
            out[chosen] = F.linear(act(gate) * up, down[expert])
            start += count
    weighted = out * weights.flatten()[order, None]
    return weighted[torch.argsort(order)].view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)


class MixtureOfExperts(nn.Module):
    """One layer's experts, router and (Qwen2-MoE) shared expert; built uninitialized, filled by
    llama_weights from the checkpoint (either layout: per-expert tensors or transformers 5's stacked)."""

    def __init__(self, config: ExpertsConfig, d_model: int, act: Activation, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.config = config
        self._act = act
        e = config.num_experts
        self.router_weight = _uninitialized(e, d_model, dtype=dtype, device=device)
        self.gate_up_weight = _uninitialized(e, 2 * config.d_ff, d_model, dtype=dtype, device=device)
        self.down_weight = _uninitialized(e, d_model, config.d_ff, dtype=dtype, device=device)
        shared = config.shared_d_ff
        self.shared_gate_up_weight = _uninitialized(2 * shared, d_model, dtype=dtype, device=device) if shared else None
        self.shared_down_weight = _uninitialized(d_model, shared, dtype=dtype, device=device) if shared else None
        self.shared_gate_weight = _uninitialized(1, d_model, dtype=dtype, device=device) if shared else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Normalized hidden states `[..., d_model]` → the MLP's update, same shape and dtype."""
        c = self.config
        x = h.reshape(-1, h.shape[-1])
        weights, experts = route(F.linear(x, self.router_weight), c.top_k, renormalize=c.renormalize,
                                 float32_weights=c.float32_weights)
        out = grouped_experts(x, weights, experts, self.gate_up_weight, self.down_weight, self._act)
        gate_up, down, gate_weight = self.shared_gate_up_weight, self.shared_down_weight, self.shared_gate_weight
        if gate_up is not None and down is not None and gate_weight is not None:
            gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
            shared = F.linear(self._act(gate) * up, down)
            out = out + torch.sigmoid(F.linear(x, gate_weight)) * shared
        return out.view(h.shape)
