"""The manifest's `weights` block: which file holds the weights, and its sha256.

A new weights format is one dataclass with its own `from_json`/`to_json`, registered in
WEIGHTS_FORMATS under the `weights.format` string that selects it; the loader then learns to
read it. The torch state_dict predates that key: its block is written without one, and a block
without one is read as it, as every shipped manifest is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from services.worker.repository.json_fields import JsonFields

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
TORCH = "torch"  # a torch.save'd state_dict, read with weights_only=True (no arbitrary unpickling)


@dataclass(frozen=True)
class WeightsRef:
    """A torch state_dict in one file of the version directory."""

    file: str  # a file name inside the version directory
    sha256: str  # lowercase hex digest of the file's bytes

    @classmethod
    def from_json(cls, w: JsonFields) -> WeightsRef:
        w.allow_only("file", "sha256")
        weights_file = w.text("file")
        if "/" in weights_file or "\\" in weights_file or weights_file.startswith("."):
            raise w.fail("file", f"must be a plain file name inside the version directory, got {weights_file!r}")
        return cls(weights_file, w.text("sha256", SHA256_RE))

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "sha256": self.sha256}


WEIGHTS_FORMATS: dict[str, type[WeightsRef]] = {TORCH: WeightsRef}


def parse_weights(w: JsonFields) -> WeightsRef:
    """The block's schema is picked by its `format` (absent: torch); that schema then refuses what it lacks."""
    fmt = w.data.get("format", TORCH)
    schema = WEIGHTS_FORMATS.get(fmt, WeightsRef) if isinstance(fmt, str) else WeightsRef
    return schema.from_json(w)
