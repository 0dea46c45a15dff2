"""A file of the version directory pinned by its sha256: `{file, sha256}` in a manifest.

A model directory brought from elsewhere (a Hugging Face checkpoint) keeps its own files, unchanged,
beside the manifest; the manifest pins each one it reads, and the loader reads none before
store.verified_file has checked it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Self

from services.worker.repository.json_fields import JsonFields

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class PinnedFile:
    file: str  # a plain file name inside the version directory
    sha256: str  # lowercase hex digest of its bytes

    @classmethod
    def from_json(cls, p: JsonFields) -> Self:
        p.allow_only("file", "sha256")
        name = p.text("file")
        if "/" in name or "\\" in name or name.startswith("."):
            raise p.fail("file", f"must be a plain file name inside the version directory, got {name!r}")
        return cls(name, p.text("sha256", SHA256_RE))

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "sha256": self.sha256}
