"""Where a mixture-of-experts layer's tensors are in a checkpoint, and where they go in the model.

Two layouts occur, one per checkpoint:

* **Per expert**, as every released checkpoint stores them and transformers' `save_pretrained`
  writes them by default: Qwen's `mlp.gate.weight` (the router) and
  `mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`; Mixtral's `block_sparse_moe.gate.weight` and
  `block_sparse_moe.experts.{e}.w1/w3/w2.weight` (gate, up, down).
* **Stacked**, transformers 5's in-memory layout, which `save_pretrained(save_original_format=False)`
  writes for all three families: `mlp.gate.weight`, `mlp.experts.gate_up_proj [num_experts,
  2 * d_ff, d_model]` (each expert's gate rows, then its up rows) and `mlp.experts.down_proj
  [num_experts, d_model, d_ff]`.

Qwen2-MoE's shared expert is `mlp.shared_expert.gate_proj/up_proj/down_proj.weight` and its gate
`mlp.shared_expert_gate.weight [1, d_model]` in both. Either layout lands in the same stacked
parameters (`experts.MixtureOfExperts`): a per-expert tensor is copied into its expert's slice.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from services.worker.models.experts import MixtureOfExperts
from services.worker.models.llama_config import ExpertsConfig

# A stacked-layout tensor's name, as the model calls it (llama_weights' model names).
STACKED_EXPERTS = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(?:gate_up_proj|down_proj)")
GATE, UP = "gate", "up"


@dataclass(frozen=True)
class ExpertPlace:
    """A checkpoint tensor's place in a layer's MixtureOfExperts: its parameter, one expert's slice
    of it (None: all of it), and the gate or the up half of its rows ("": all rows)."""

    attribute: str
    expert: int | None = None
    half: str = ""


def expert_places(config: ExpertsConfig, *, mixtral: bool, stacked: bool) -> dict[str, ExpertPlace]:
    """Each expert tensor of one layer, by its name under the layer (`model.layers.{i}.`), in the
    layout a checkpoint stores (`stacked`, or per expert as Mixtral or Qwen names them)."""
    places: dict[str, ExpertPlace] = {}
    if stacked:
        places["mlp.gate.weight"] = ExpertPlace("router_weight")
        places["mlp.experts.gate_up_proj"] = ExpertPlace("gate_up_weight")
        places["mlp.experts.down_proj"] = ExpertPlace("down_weight")
    else:
        block, gate, up, down = (("block_sparse_moe", "w1", "w3", "w2") if mixtral
                                 else ("mlp", "gate_proj", "up_proj", "down_proj"))
        places[f"{block}.gate.weight"] = ExpertPlace("router_weight")
        for e in range(config.num_experts):
            places[f"{block}.experts.{e}.{gate}.weight"] = ExpertPlace("gate_up_weight", e, GATE)
            places[f"{block}.experts.{e}.{up}.weight"] = ExpertPlace("gate_up_weight", e, UP)
            places[f"{block}.experts.{e}.{down}.weight"] = ExpertPlace("down_weight", e)
    if config.shared_d_ff:
        places["mlp.shared_expert.gate_proj.weight"] = ExpertPlace("shared_gate_up_weight", None, GATE)
        places["mlp.shared_expert.up_proj.weight"] = ExpertPlace("shared_gate_up_weight", None, UP)
        places["mlp.shared_expert.down_proj.weight"] = ExpertPlace("shared_down_weight")
        places["mlp.shared_expert_gate.weight"] = ExpertPlace("shared_gate_weight")
    return places


def expert_shape(place: ExpertPlace, config: ExpertsConfig, d_model: int) -> tuple[int, ...]:
    """The shape the checkpoint must store the tensor at `place` in."""
    e, d_ff, shared = config.num_experts, config.d_ff, config.shared_d_ff
    shape = {"router_weight": (e, d_model), "gate_up_weight": (e, 2 * d_ff, d_model),
             "down_weight": (e, d_model, d_ff), "shared_gate_up_weight": (2 * shared, d_model),
             "shared_down_weight": (d_model, shared), "shared_gate_weight": (1, d_model)}[place.attribute]
    if place.expert is not None:
        shape = shape[1:]
    if place.half:
        shape = (shape[0] // 2, *shape[1:])
    return shape


def expert_view(place: ExpertPlace, experts: MixtureOfExperts) -> torch.Tensor:
    """The view of the layer's parameter the tensor at `place` is copied into."""
    tensor = getattr(experts, place.attribute)
    if place.expert is not None:
        tensor = tensor[place.expert]
    if place.half:
        rows = tensor.shape[0] // 2
        tensor = tensor[:rows] if place.half == GATE else tensor[rows:]
    return tensor


def stores_stacked(names: Iterable[str]) -> bool:
    """Whether a checkpoint's tensors (model names) are the stacked layout."""
    return any(STACKED_EXPERTS.fullmatch(name) for name in names)
