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

The experts run one of two ways (`expert_rows`), bit for bit the same on CPU: two grouped matmuls
(`F.grouped_mm`, which costs a little for every expert, chosen or not), or a Python loop over the
chosen experts (which costs several operator calls for each). A step of many rows an expert takes the
first, a decode step of a few tokens over many experts the second. On CPU most of either is the
matmuls themselves, a few rows through each expert's weights (bench/worker/bench_moe_layer.py).

Eager only: the loop reads each expert's row count on the host, and grouped_mm reads it too wherever
it has no fused kernel (on CPU; on CUDA it has one for bfloat16 on recent GPUs), and a graph records
no host read; the worker serves these models without decode graphs
(services/worker/decode_graph_steps.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.models.llama_config import ExpertsConfig

Activation = Callable[[torch.Tensor], torch.Tensor]

# Rows an expert (tokens x top_k / num_experts) from which grouped_mm beats the loop, measured on CPU
# with one thread (bench/worker/bench_moe_layer.py): grouped_mm pays for every expert (about 5 us for
# its two calls), the loop only for the chosen ones, but about six times as much (its operator calls).
GROUPED_MM_ROWS_PER_EXPERT = 0.25


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

    `experts int64[num_tokens, top_k]` and `weights [num_tokens, top_k]` as `route` gives them; each
    chosen expert runs once over the rows that chose it (`expert_rows`). A token's weighted outputs
    (float32 with float32 weights) are summed with one rounding to the compute dtype, as transformers
    5's default experts forward (grouped_mm) sums them."""
    num_tokens, top_k = experts.shape
    choices = experts.flatten()  # token-major: token t's choices are rows t * top_k ...
    by_expert, order = torch.sort(choices, stable=True)  # ... and here expert-major, token order within one
    out = expert_rows(x[order // top_k], by_expert, gate_up, down, act)
    weighted = out * weights.flatten()[order, None]
    return weighted[torch.argsort(order)].view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)


def expert_rows(rows: torch.Tensor, by_expert: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                act: Activation) -> torch.Tensor:
    """`rows [num_rows, d_model]` sorted by their expert (`by_expert int64[num_rows]`, ascending), each
    through its expert's gated MLP: `[num_rows, d_model]`, bit for bit the same on CPU whichever way runs.

    Two grouped matmuls where there are at least `GROUPED_MM_ROWS_PER_EXPERT` rows an expert (on
    average) and the shapes suit grouped_mm; else a loop over the chosen experts."""
    num_experts, d_ff = gate_up.shape[0], down.shape[-1]
    aligned = all(n * rows.element_size() % 16 == 0 for n in (rows.shape[-1], d_ff))
    if aligned and rows.shape[0] >= GROUPED_MM_ROWS_PER_EXPERT * num_experts:
        return grouped_mm_rows(rows, by_expert, gate_up, down, act)
    return per_expert_rows(rows, by_expert, gate_up, down, act)


def grouped_mm_rows(rows: torch.Tensor, by_expert: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    act: Activation) -> torch.Tensor:
    """`expert_rows` as two `F.grouped_mm`s (one kernel each on CUDA in bfloat16; elsewhere torch loops
    over the experts in C++, a few microseconds an expert, chosen or not). The rows' stride must be a
    multiple of 16 bytes (d_model and d_ff)."""
    # ends[e]: one past expert e's last row (int32, as grouped_mm takes it), found without a host read.
    ends = torch.searchsorted(by_expert, torch.arange(gate_up.shape[0], device=rows.device), right=True,
                              out_int32=True)
    gate, up = F.grouped_mm(rows, gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
    return F.grouped_mm(act(gate) * up, down.transpose(1, 2), offs=ends)


def per_expert_rows(rows: torch.Tensor, by_expert: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    act: Activation) -> torch.Tensor:
    """`expert_rows` as a Python loop over the chosen experts, a few operator calls each, after one host
    read of the rows per expert."""
    out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(torch.bincount(by_expert, minlength=gate_up.shape[0]).tolist()):
        if count:
            chosen = slice(start, start + count)
            gate, up = F.linear(rows[chosen], gate_up[expert]).chunk(2, dim=-1)
            out[chosen] = F.linear(act(gate) * up, down[expert])
            start += count
    return out


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
