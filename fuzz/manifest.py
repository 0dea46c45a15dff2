"""atheris: a model manifest (services/worker/repository/store.py: load_manifest), bytes as on disk."""

from __future__ import annotations

import atheris

from fuzz.harness import ScratchFile, fuzz

with atheris.instrument_imports(include=["services.worker.repository"]):
    from services.worker.repository.errors import ModelRepositoryError
    from services.worker.repository.manifest import MANIFEST_FILE
    from services.worker.repository.store import load_manifest

_FILE = ScratchFile(f"digits/1/{MANIFEST_FILE}")


def check(data: bytes) -> None:
    _FILE.write(data)
    try:
        load_manifest(_FILE.root, "digits", "1")
    except ModelRepositoryError:
        pass


if __name__ == "__main__":
    fuzz(check)
