"""The repository on disk: `<root>/<name>/<version>/manifest.json` beside the files it names.

A version directory is immutable once written: the manifest pins its files' sha256 and there is
no `latest` alias — callers name the exact version.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import NotFound
from services.worker.repository.errors import ChecksumMismatch, ImportRefused, InvalidManifest
from services.worker.repository.manifest import (
    MANIFEST_FILE,
    NAME_RE,
    Manifest,
    manifest_to_dict,
    parse_manifest,
)


@dataclass(frozen=True)
class ModelVersion:
    name: str
    version: str


def list_models(root: str | Path) -> list[ModelVersion]:
    """Every `<name>/<version>` under root that has a manifest, sorted (numeric versions numerically)."""
    root = Path(root)
    if not root.is_dir():
        raise NotFound(f"model repository {root} does not exist")
    found = [
        ModelVersion(manifest.parent.parent.name, manifest.parent.name)
        for manifest in root.glob(f"*/*/{MANIFEST_FILE}")
        if NAME_RE.match(manifest.parent.parent.name) and NAME_RE.match(manifest.parent.name)
    ]
    return sorted(found, key=lambda m: (m.name, _version_key(m.version)))


def version_dir(root: str | Path, name: str, version: str) -> Path:
    for what, value in (("name", name), ("version", version)):
        if not NAME_RE.match(value):
            raise NotFound(f"model {what} {value!r} is not a valid repository {what}")
    if version == "latest":
        raise NotFound("there is no 'latest' version; name an exact version")
    return Path(root) / name / version


def check_new_version(directory: Path) -> None:
    """ImportRefused when an import would write into an existing version: versions are immutable."""
    if directory.exists():
        raise ImportRefused(f"{directory} already exists; a version is immutable: import under another --version")


def load_manifest(root: str | Path, name: str, version: str) -> Manifest:
    path = version_dir(root, name, version) / MANIFEST_FILE
    if not path.is_file():
        raise NotFound(f"model {name}/{version} not found in {root} (no {path})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:  # Recursion: too deep
        raise InvalidManifest(f"{path}: not valid JSON: {exc}") from None
    manifest = parse_manifest(data, source=str(path))
    if (manifest.name, manifest.version) != (name, version):
        raise InvalidManifest(
            f"{path}: manifest says {manifest.name}/{manifest.version} but lives in {name}/{version}"
        )
    return manifest


def write_manifest(manifest: Manifest, directory: Path) -> Path:
    """Validates by round-tripping, then writes `directory/manifest.json`."""
    data = manifest_to_dict(manifest)
    parse_manifest(data, source=str(directory / MANIFEST_FILE))
    path = directory / MANIFEST_FILE
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return path


def verified_file(directory: Path, name: str, sha256: str, what: str) -> Path:
    """`directory/name`, once its bytes are known to hash to `sha256`; `what` names the file in messages
    ("weights", "tokenizer"). Checked before anything reads the file, so nothing modified is deserialized."""
    path = directory / name
    if not path.is_file():
        raise InvalidManifest(f"{directory / MANIFEST_FILE}: {what} file {path} is missing")
    check_sha256(path, sha256_of(path), sha256, what)
    return path


def check_sha256(path: Path, actual: str, expected: str, what: str) -> None:
    """ChecksumMismatch unless a file's bytes (hashed by the caller: `actual`) are the pinned ones."""
    if actual != expected:
        raise ChecksumMismatch(
            f"{what} file {path} has sha256 {actual} but the manifest expects {expected}; "
            "refusing to load a modified model version"
        )


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _version_key(version: str) -> tuple[int, int | str]:
    return (0, int(version)) if version.isdigit() else (1, version)
