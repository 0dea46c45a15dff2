"""The demo models shipped in model_repo/ are what their recipes build, on any CPU.

The repository carries the built digits and tinylm so a fresh clone serves at
once; the recipe in tools/build_models.py stays the source of truth. A recipe
changed without rebuilding the shipped model fails here, and digits (seconds to
train) is rebuilt from scratch and compared: bit for bit on the platform recorded
in its manifest, elsewhere golden outputs, quality and weights within
docs/models.md's tolerances (issue 31). tinylm's rebuild takes minutes: `make
models` checks it.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from services.worker.repository.manifest import Manifest
from services.worker.repository.store import load_manifest, sha256_of, write_manifest
from tools.build_models import DigitsRecipe, TinyLMRecipe, build_digits, compare_builds, recipe_digest, report
from tools.build_platform import PLATFORM_KEYS, current_platform, platform_differences, recorded_platform
from tools.rebuild_check import BIT_FOR_BIT, TOLERANCE, Tolerances

SHIPPED_ROOT = Path(__file__).resolve().parents[3] / "model_repo"
ELSEWHERE = {"torch": "2.13.0+cpu", "numpy": "2.4.6", "aten_cpu_capability": "AVX512",
             "onednn_isa": "Intel AVX-512 with Intel AMX", "cpu": "GenuineIntel family 6 model 167: a CPU not this one",
             "mkl_env": "unset"}


@pytest.fixture(scope="module")
def rebuilt_digits_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rebuilt")
    build_digits(root, DigitsRecipe(), force=True, log=lambda _: None)
    return root


def shipped_copy(tmp_path: Path, edit=lambda weights, manifest: manifest) -> Path:
    """model_repo/digits copied under tmp_path, its weights and manifest changed by `edit`, kept intact (sha256)."""
    recipe = DigitsRecipe()
    shutil.copytree(SHIPPED_ROOT / recipe.name, tmp_path / recipe.name)
    version_dir = tmp_path / recipe.name / recipe.version
    manifest = load_manifest(tmp_path, recipe.name, recipe.version)
    path = version_dir / manifest.weights.file
    weights = torch.load(path, weights_only=True)
    manifest = edit(weights, manifest)
    torch.save(weights, path)
    write_manifest(dataclasses.replace(manifest, weights=dataclasses.replace(manifest.weights, sha256=sha256_of(path))),
                   version_dir)
    return tmp_path


def on_platform(manifest: Manifest, platform: dict[str, str]) -> Manifest:
    return dataclasses.replace(manifest, build={**manifest.build, **platform})


@pytest.mark.parametrize("recipe", [DigitsRecipe(), TinyLMRecipe()], ids=lambda r: r.name)
def test_shipped_model_was_built_from_the_current_recipe(recipe):
    manifest = load_manifest(SHIPPED_ROOT, recipe.name, recipe.version)
    assert manifest.build["recipe_sha256"] == recipe_digest(recipe), (
        f"tools/build_models.py's {recipe.name} recipe changed but model_repo/{recipe.name}/{recipe.version} "
        f"was not rebuilt: bump the version or rebuild it (python -m tools.build_models --force --only {recipe.name})"
    )
    weights = SHIPPED_ROOT / recipe.name / recipe.version / manifest.weights.file
    assert sha256_of(weights) == manifest.weights.sha256


def test_a_build_records_the_platform_its_bits_depend_on(rebuilt_digits_root):
    build = load_manifest(rebuilt_digits_root, "digits", "1").build
    assert recorded_platform(build) == current_platform()
    assert set(PLATFORM_KEYS) <= set(build)
    assert build["aten_cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_digits_rebuilt_from_scratch_matches_the_shipped_one(rebuilt_digits_root):
    """Bit for bit where this CPU is the recorded one; within the tolerances on any other."""
    shipped = load_manifest(SHIPPED_ROOT, "digits", "1")
    same_platform = not platform_differences(recorded_platform(shipped.build), current_platform())
    check = compare_builds(SHIPPED_ROOT, rebuilt_digits_root, DigitsRecipe())
    assert check.ok, "\n".join(report(check))
    assert check.mode == (BIT_FOR_BIT if same_platform else TOLERANCE), check.reason


def test_digits_rebuilt_here_is_within_tolerance_of_the_shipped_one_whatever_the_platform(rebuilt_digits_root):
    # The comparison another CPU makes, made on this one too (here often trivially: identical bits).
    check = compare_builds(SHIPPED_ROOT, rebuilt_digits_root, DigitsRecipe(), mode=TOLERANCE)
    assert check.ok, "\n".join(report(check))
    assert any("golden images: top-1 identical" in f for f in check.findings)
    assert any("largest relative L2 difference" in f for f in check.findings)


def test_on_the_recorded_platform_weights_the_recipe_does_not_produce_are_reported(tmp_path, rebuilt_digits_root):
    here = recorded_platform(load_manifest(rebuilt_digits_root, "digits", "1").build)

    def nudge(weights, manifest):
        weights["head.4.bias"][0] += 1e-6  # far inside any tolerance: only bit for bit catches it
        return on_platform(manifest, here)

    check = compare_builds(shipped_copy(tmp_path, nudge), rebuilt_digits_root, DigitsRecipe())
    assert check.mode == BIT_FOR_BIT
    assert any("weights sha256" in p for p in check.problems), check.problems


def test_elsewhere_the_comparison_says_why_and_passes_a_faithful_rebuild(tmp_path, rebuilt_digits_root):
    shipped = shipped_copy(tmp_path, lambda weights, manifest: on_platform(manifest, ELSEWHERE))
    check = compare_builds(shipped, rebuilt_digits_root, DigitsRecipe())
    assert check.mode == TOLERANCE
    assert "onednn_isa" in check.reason and "cpu" in check.reason
    assert check.ok, "\n".join(report(check))


def test_elsewhere_weights_too_far_from_the_shipped_ones_are_reported(tmp_path, rebuilt_digits_root):
    def negate(weights, manifest):
        weights["features.0.weight"] *= -1  # relative L2 difference 2
        return on_platform(manifest, ELSEWHERE)

    assert Tolerances().weights_relative_l2 < 2
    check = compare_builds(shipped_copy(tmp_path, negate), rebuilt_digits_root, DigitsRecipe())
    assert check.mode == TOLERANCE
    assert any("weight features.0.weight: relative L2 difference" in p for p in check.problems), check.problems


def test_elsewhere_a_golden_output_that_differs_is_reported(tmp_path, rebuilt_digits_root):
    def wrong_golden(weights, manifest):
        c = manifest.classifier
        first = dataclasses.replace(c.golden[0], expected_top1=(c.golden[0].expected_top1 + 1) % 10)
        manifest = dataclasses.replace(manifest, classifier=dataclasses.replace(c, golden=(first, *c.golden[1:])))
        return on_platform(manifest, ELSEWHERE)

    check = compare_builds(shipped_copy(tmp_path, wrong_golden), rebuilt_digits_root, DigitsRecipe())
    assert any("golden outputs differ" in p for p in check.problems), check.problems


def test_elsewhere_held_out_accuracy_beyond_the_tolerance_is_reported(tmp_path, rebuilt_digits_root):
    def better(weights, manifest):
        accuracy = manifest.quality["heldout_accuracy"]
        quality = {**manifest.quality, "heldout_accuracy": accuracy - 2 * Tolerances().heldout_accuracy_abs}
        return on_platform(dataclasses.replace(manifest, quality=quality), ELSEWHERE)

    check = compare_builds(shipped_copy(tmp_path, better), rebuilt_digits_root, DigitsRecipe())
    assert any(p.startswith("digits/1: heldout_accuracy") for p in check.problems), check.problems


def test_a_shipped_build_from_another_recipe_fails_on_any_platform(tmp_path, rebuilt_digits_root):
    def other_recipe(weights, manifest):
        return on_platform(dataclasses.replace(manifest, build={**manifest.build, "recipe_sha256": "0" * 64}),
                           current_platform())

    check = compare_builds(shipped_copy(tmp_path, other_recipe), rebuilt_digits_root, DigitsRecipe())
    assert not check.ok and "built from another recipe" in check.problems[0]
