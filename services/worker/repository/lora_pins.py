"""The manifest's `generator.lora_adapters`: LoRA adapters pinned in a repository version.

`infermesh models import DIR --lora NAME=ADAPTER_DIR` copies each adapter's two files beside the model,
renamed `lora.NAME.adapter_config.json` and `lora.NAME.adapter_model.safetensors` (a pinned file is a
plain name in the version directory), and pins each by sha256; the loader checks both before it reads
them (store.verified_file) and serves each adapter as a model name of its own (docs/models.md,
"LoRA adapters").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Self

from services.worker.repository.json_fields import JsonFields
from services.worker.repository.lora_spec import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from services.worker.repository.pinned_file import PinnedFile

# An adapter's name is a model name on the API and part of its files' names: no '/', no leading dot.
ADAPTER_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def pinned_names(name: str) -> tuple[str, str]:
    """The names an adapter's adapter_config.json and adapter_model.safetensors take in a version directory."""
    return f"lora.{name}.{ADAPTER_CONFIG_FILE}", f"lora.{name}.{ADAPTER_WEIGHTS_FILE}"


@dataclass(frozen=True)
class LoraPin:
    name: str  # the model name it is served as
    config: PinnedFile  # its adapter_config.json
    weights: PinnedFile  # its adapter_model.safetensors

    @classmethod
    def from_json(cls, x: JsonFields) -> Self:
        x.allow_only("name", "config", "weights")
        return cls(x.text("name", ADAPTER_NAME_RE), PinnedFile.from_json(x.obj("config")),
                   PinnedFile.from_json(x.obj("weights")))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "config": self.config.to_json(), "weights": self.weights.to_json()}
