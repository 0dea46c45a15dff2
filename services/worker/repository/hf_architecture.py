"""The generator's `architecture` block for a Hugging Face checkpoint (`format: "hf"`).

The architecture is config.json itself, pinned beside the manifest and parsed at load
(models/llama_config.py); the manifest repeats what a reader and the checks here need: the
architecture's name, refused unless supported, and vocab_size, checked against the tokenizer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.worker.models.llama_config import SUPPORTED_ARCHITECTURES
from services.worker.repository.json_fields import JsonFields
from services.worker.repository.pinned_file import PinnedFile

HF_CONFIG = "hf"


@dataclass(frozen=True)
class HFArchitecture:
    config: PinnedFile  # config.json
    architecture: str  # its architectures[0], one of SUPPORTED_ARCHITECTURES
    vocab_size: int  # its vocab_size

    @classmethod
    def from_json(cls, a: JsonFields) -> HFArchitecture:
        a.allow_only("format", "config", "architecture", "vocab_size")
        name = a.text("architecture")
        if name not in SUPPORTED_ARCHITECTURES:
            raise a.fail("architecture", f"{name!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        return cls(PinnedFile.from_json(a.obj("config")), name, a.integer("vocab_size", 1))

    def to_json(self) -> dict[str, Any]:
        return {"format": HF_CONFIG, "config": self.config.to_json(), "architecture": self.architecture,
                "vocab_size": self.vocab_size}
