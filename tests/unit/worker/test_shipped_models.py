"""The demo models shipped in model_repo/ are exactly what their recipes build.

The repository carries the built digits and tinylm so a fresh clone serves at
once; the recipe in tools/build_models.py stays the source of truth. A recipe
changed without rebuilding the shipped model fails here, and digits (seconds to
train) is rebuilt from scratch and compared byte for byte. tinylm's rebuild
takes minutes: `make models` checks it.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from services.worker.repository.store import load_manifest, sha256_of, write_manifest
from tools.build_models import DigitsRecipe, TinyLMRecipe, build_digits, compare_builds, recipe_digest

SHIPPED_ROOT = Path(__file__).resolve().parents[3] / "model_repo"


@pytest.fixture(scope="module")
def rebuilt_digits_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rebuilt")
    build_digits(root, DigitsRecipe(), force=True, log=lambda _: None)
    return root


@pytest.mark.parametrize("recipe", [DigitsRecipe(), TinyLMRecipe()], ids=lambda r: r.name)
def test_shipped_model_was_built_from_the_current_recipe(recipe):
    manifest = load_manifest(SHIPPED_ROOT, recipe.name, recipe.version)
    assert manifest.build["recipe_sha256"] == recipe_digest(recipe), (
        f"tools/build_models.py's {recipe.name} recipe changed but model_repo/{recipe.name}/{recipe.version} "
        f"was not rebuilt: bump the version or rebuild it (python -m tools.build_models --force --only {recipe.name})"
    )
    weights = SHIPPED_ROOT / recipe.name / recipe.version / manifest.weights.file
    assert sha256_of(weights) == manifest.weights.sha256


def test_digits_rebuilt_from_scratch_is_bit_identical_to_the_shipped_one(rebuilt_digits_root):
    assert compare_builds(SHIPPED_ROOT, rebuilt_digits_root, DigitsRecipe()) == []


def test_shipped_weights_that_the_recipe_does_not_produce_are_reported(tmp_path, rebuilt_digits_root):
    # Intact (sha256 updated to match) but not what the recipe produces.
    recipe = DigitsRecipe()
    shutil.copytree(SHIPPED_ROOT / recipe.name, tmp_path / recipe.name)
    version_dir = tmp_path / recipe.name / recipe.version
    manifest = load_manifest(tmp_path, recipe.name, recipe.version)
    weights = version_dir / manifest.weights.file
    weights.write_bytes(weights.read_bytes() + b"\0")
    write_manifest(dataclasses.replace(manifest, weights=dataclasses.replace(manifest.weights, sha256=sha256_of(weights))),
                   version_dir)
    problems = compare_builds(tmp_path, rebuilt_digits_root, recipe)
    assert any("weights sha256" in p for p in problems), problems
