"""LoRA adapters on a served `LlamaFamilyLM`: many adapters and the base in one step (punica / S-LoRA style).

Each adapted linear computes `base(x) + scale * (x A^T) B^T`, but only for the rows (tokens) of the
step whose sequence uses that adapter: per adapter, its rows are gathered, run through the two small
matmuls and added back with `index_add_`. The base matmul runs once over every row, as without
adapters. A step with no adapter rows leaves the forward untouched: each block's `lora` hook returns
its input when no rows are bound, and a model with no adapters loaded has no hook at all.

The model fuses q/k/v and gate/up into one linear each (llama_family); an adapter's parts are placed
at their offsets there: its A matrices stacked along the rank, its B matrices on the block diagonal of
a zero matrix, `scale` folded in. A Phi-3 adapter's qkv_proj / gate_up_proj is already fused.

Which adapter a sequence uses is `PagedSequence.adapter` (its name; "" is the base model).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from services.worker.models.llama_config import LlamaFamilyConfig
from services.worker.models.llama_family import LlamaFamilyLM
from services.worker.models.paged import PagedSequence
from services.worker.repository.lora_spec import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    LoraConfig,
    LoraTensorPair,
    check_lora_weights,
    lora_shape,
    read_lora_config,
)

# The block's fused linears (llama_family) an adapter's modules land in.
QKV, OUT, GATE_UP, DOWN = "qkv", "o", "gate_up", "down"


def _placement(module: str, config: LlamaFamilyConfig) -> tuple[str, int]:
    """The fused linear `module` belongs to, and the first output row it fills there."""
    c = config
    q_size, kv_size = c.num_heads * c.head_size, c.num_kv_heads * c.head_size
    return {
        "q_proj": (QKV, 0), "k_proj": (QKV, q_size), "v_proj": (QKV, q_size + kv_size), "qkv_proj": (QKV, 0),
        "o_proj": (OUT, 0), "gate_proj": (GATE_UP, 0), "up_proj": (GATE_UP, c.d_ff), "gate_up_proj": (GATE_UP, 0),
        "down_proj": (DOWN, 0),
    }[module]


@dataclass(frozen=True)
class LoraFactors:
    """One adapter on one fused linear: `delta(x) = (x a^T) b^T`, scale folded into b."""

    a: torch.Tensor  # [k * rank, in] for the k modules it adapts there
    b: torch.Tensor  # [out, k * rank], zero outside each module's rows


@dataclass(frozen=True)
class LoraAdapter:
    """A loaded adapter: its factors by (layer, fused linear)."""

    name: str
    config: LoraConfig
    factors: dict[tuple[int, str], LoraFactors]


def load_lora_adapter(name: str, directory: str | Path, config: LlamaFamilyConfig, *,
                      dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                      config_file: str = ADAPTER_CONFIG_FILE, weights_file: str = ADAPTER_WEIGHTS_FILE) -> LoraAdapter:
    """Reads and checks a PEFT adapter directory (lora_spec) against the base `config`, and builds its
    factors in the compute `dtype` on `device`. CheckpointError names the field or tensor refused.
    `config_file` / `weights_file`: the files' names there (a repository version pins them renamed)."""
    lora = read_lora_config(directory, config, file=config_file)
    pairs = check_lora_weights(directory, lora, config, file=weights_file)
    path = Path(directory) / weights_file
    with safe_open(str(path), framework="pt", device="cpu") as weights:
        loaded = [(p, weights.get_tensor(p.a_name).float(), weights.get_tensor(p.b_name).float()) for p in pairs]
    return LoraAdapter(name, lora, _fuse(loaded, lora, config, dtype, torch.device(device)))


def _fuse(loaded: Sequence[tuple[LoraTensorPair, torch.Tensor, torch.Tensor]], lora: LoraConfig,
          config: LlamaFamilyConfig, dtype: torch.dtype, device: torch.device) -> dict[tuple[int, str], LoraFactors]:
    by_linear: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for pair, a, b in loaded:
        linear, offset = _placement(pair.module, config)
        by_linear.setdefault((pair.layer, linear), []).append((offset, a, b))
    out_features = {QKV: lora_shape("q_proj", config)[1] + 2 * lora_shape("k_proj", config)[1],
                    OUT: config.d_model, GATE_UP: 2 * config.d_ff, DOWN: config.d_model}
    r = lora.rank
    factors = {}
    for (layer, linear), parts in by_linear.items():
        a = torch.cat([p[1] for p in parts])
        b = torch.zeros(out_features[linear], r * len(parts))
        for i, (offset, _, part_b) in enumerate(parts):
            b[offset:offset + part_b.shape[0], i * r:(i + 1) * r] = part_b * lora.scale
        factors[(layer, linear)] = LoraFactors(a.to(device, dtype), b.to(device, dtype))
    return factors


class LoraRows:
    """The current step's rows per adapter slot: bound around a step's forward, empty otherwise."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, torch.Tensor]] = []  # (slot, int64 row indices)


class LayerLora:
    """One block's adapters: each fused linear's factors by adapter slot. The block calls `add` after
    each linear; it returns `out` itself when the step binds no adapter rows."""

    def __init__(self, rows: LoraRows) -> None:
        self._rows = rows
        self.factors: dict[str, dict[int, LoraFactors]] = {}

    def add(self, linear: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        groups = self._rows.groups
        if not groups:
            return out
        by_slot = self.factors.get(linear)
        if not by_slot:
            return out
        for slot, rows in groups:
            f = by_slot.get(slot)
            if f is not None:
                out.index_add_(0, rows, (x.index_select(0, rows) @ f.a.T) @ f.b.T)
        return out


class LoraSet:
    """The adapters a model serves, by name: installs a `LayerLora` on each block of `lm` and binds a
    step's rows to them (`bound`)."""

    def __init__(self, lm: LlamaFamilyLM) -> None:
        self._lm = lm
        self._rows = LoraRows()
        self._layers = [LayerLora(self._rows) for _ in lm.blocks()]
        self._slots: dict[str, int] = {}
        for block, layer in zip(lm.blocks(), self._layers, strict=True):
            block.lora = layer

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._slots)

    def add(self, adapter: LoraAdapter) -> None:
        if not adapter.name:
            raise ValueError("an adapter needs a name ('' is the base model)")
        if adapter.name in self._slots:
            raise ValueError(f"adapter {adapter.name!r} is already loaded")
        slot = len(self._slots)
        self._slots[adapter.name] = slot
        for (layer, linear), f in adapter.factors.items():
            self._layers[layer].factors.setdefault(linear, {})[slot] = f

    def unknown(self, seqs: Sequence[PagedSequence]) -> str | None:
        """The first adapter `seqs` name that is not loaded; None when all are."""
        return next((s.adapter for s in seqs if s.adapter and s.adapter not in self._slots), None)

    @contextmanager
    def bound(self, seqs: Sequence[PagedSequence]) -> Iterator[None]:
        """Binds each adapter's rows of the step `seqs` (their new tokens, concatenated in order, as
        paged_forward lays them out) for the forward run inside; KeyError names an unknown adapter."""
        rows: dict[int, list[int]] = {}
        start = 0
        for seq in seqs:
            if seq.adapter:
                if seq.adapter not in self._slots:
                    raise KeyError(f"adapter {seq.adapter!r} is not loaded")
                rows.setdefault(self._slots[seq.adapter], []).extend(range(start, start + len(seq.token_ids)))
            start += len(seq.token_ids)
        device = self._lm.device
        self._rows.groups = [(slot, torch.tensor(r, dtype=torch.int64, device=device)) for slot, r in rows.items()]
        try:
            yield
        finally:
            self._rows.groups = []
