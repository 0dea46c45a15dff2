"""The manifest's `weights` block: which files hold the weights, and their sha256.

A new weights format is one dataclass with its own `from_json`/`to_json`, registered in
WEIGHTS_FORMATS under the `weights.format` string that selects it; the loader then learns to
read it. The torch state_dict predates that key: its block is written without one, and a block
without one is read as it, as every shipped manifest is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.worker.repository.json_fields import JsonFields
from services.worker.repository.pinned_file import PinnedFile

TORCH = "torch"  # a torch.save'd state_dict, read with weights_only=True (no arbitrary unpickling)
SAFETENSORS = "safetensors"  # a Hugging Face checkpoint's *.safetensors, memory-mapped (no pickle)


@dataclass(frozen=True)
class WeightsRef(PinnedFile):
    """A torch state_dict in one file of the version directory: a pinned file, block and all."""


@dataclass(frozen=True)
class SafetensorsWeights:
    """A Hugging Face checkpoint's weights: one `model.safetensors`, or shards with their index, each
    pinned. Their tensors are checked against config.json (names, shapes, dtypes) before any is read."""

    files: tuple[PinnedFile, ...]  # every *.safetensors file, sorted by name
    index: PinnedFile | None  # model.safetensors.index.json for shards; None for a single file

    @classmethod
    def from_json(cls, w: JsonFields) -> SafetensorsWeights:
        w.allow_only("format", "files", "index")
        files = tuple(PinnedFile.from_json(f) for f in w.items("files", 1))
        names = [f.file for f in files]
        if not all(name.endswith(".safetensors") for name in names) or len(set(names)) != len(names):
            raise w.fail("files", f"must name distinct .safetensors files, got {names}")
        index = PinnedFile.from_json(w.obj("index")) if w.data.get("index") is not None else None
        if index is None and len(files) != 1:
            raise w.fail("index", f"is required for {len(files)} shards (model.safetensors.index.json)")
        return cls(files, index)

    def to_json(self) -> dict[str, Any]:
        return {"format": SAFETENSORS, "files": [f.to_json() for f in self.files],
                "index": None if self.index is None else self.index.to_json()}

    @property
    def pinned(self) -> tuple[PinnedFile, ...]:
        """Every file the loader reads, index first."""
        return self.files if self.index is None else (self.index, *self.files)


Weights = WeightsRef | SafetensorsWeights
WEIGHTS_FORMATS: dict[str, type[Weights]] = {TORCH: WeightsRef, SAFETENSORS: SafetensorsWeights}


def parse_weights(w: JsonFields) -> Weights:
    """The block's schema is picked by its `format` (absent: torch); that schema then refuses what it lacks."""
    fmt = w.data.get("format", TORCH)
    schema = WEIGHTS_FORMATS.get(fmt, WeightsRef) if isinstance(fmt, str) else WeightsRef
    return schema.from_json(w)
