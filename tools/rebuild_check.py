"""Does a fresh rebuild of a demo model match the shipped one? Bit for bit where it can; within tolerances elsewhere.

A rebuild reproduces the shipped bits only on the platform recorded with them
(tools/build_platform.py). On any other platform the two trainings round
differently, the difference grows over the training steps, and what a rebuild
can promise is what the model *does*: the same golden outputs, the same quality
within a tolerance, and weights near the shipped ones. docs/models.md states the
tolerances and the figures they come from.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from services.worker.models.generator import Generator
from services.worker.repository.errors import GoldenCheckFailed, ModelRepositoryError
from services.worker.repository.generator_spec import GoldenGeneration
from services.worker.repository.golden import run_golden_check
from services.worker.repository.loader import load_model
from services.worker.repository.manifest import Manifest
from services.worker.repository.store import load_manifest
from tools.build_platform import PLATFORM_KEYS, platform_differences, recorded_platform

BIT_FOR_BIT = "bit-for-bit"
TOLERANCE = "tolerance"


@dataclass(frozen=True)
class Tolerances:
    """How far a rebuild on another platform may land from the shipped model (docs/models.md)."""

    # Per tensor, ||rebuilt - shipped|| / ||shipped||. Rounding drift measured 0.15-0.18 (digits,
    # AVX2 and baseline x86-64 kernels against the AVX-512 build); another seed gives ~1.
    weights_relative_l2: float = 0.5
    heldout_accuracy_abs: float = 0.02  # 7 of digits' 360 held-out images; measured drift <= 0.003
    heldout_bits_per_byte_abs: float = 0.05  # tinylm's held-out bits per byte (2.03 shipped)
    # A generator's golden token must be reproduced where the shipped model chose it by at least
    # this many logits over the runner-up (the shipped tinylm's smallest lead is 0.027).
    golden_decisive_logit_gap: float = 1.0


# quality keys: compared within a tolerance, compared exactly, or only reported (they say how a
# training run went, e.g. its last batch's loss or its duration, not what it produced).
_QUALITY_TOLERANCE = {"heldout_accuracy": "heldout_accuracy_abs",
                      "heldout_bits_per_byte": "heldout_bits_per_byte_abs"}
_QUALITY_EXACT = ("num_heldout", "num_parameters")
RUN_FIELDS = ("train_seconds",)  # differ between any two builds, even bit-identical ones


@dataclass(frozen=True)
class RebuildCheck:
    name: str
    version: str
    mode: str  # BIT_FOR_BIT or TOLERANCE
    reason: str  # why this mode
    findings: tuple[str, ...]  # what was compared, with the figures
    problems: tuple[str, ...]  # empty: the rebuild matches

    @property
    def ok(self) -> bool:
        return not self.problems


def choose_mode(shipped: Manifest, rebuilt: Manifest) -> tuple[str, str]:
    """BIT_FOR_BIT when the rebuild ran on the platform recorded with the shipped build, else TOLERANCE."""
    current = recorded_platform(rebuilt.build)
    differences = platform_differences(recorded_platform(shipped.build), current)
    if not differences:
        return BIT_FOR_BIT, f"same platform as recorded ({current['aten_cpu_capability']}, {current['cpu']})"
    return TOLERANCE, "platform differs from the recorded one: " + "; ".join(differences)


def compare(shipped_root: Path, rebuilt_root: Path, name: str, version: str,
            tolerances: Tolerances = Tolerances(), mode: str | None = None) -> RebuildCheck:
    """Compare the rebuild in `rebuilt_root` with the shipped build; `mode` overrides the platform's choice."""
    shipped = load_manifest(shipped_root, name, version)
    rebuilt = load_manifest(rebuilt_root, name, version)
    chosen, reason = choose_mode(shipped, rebuilt)
    if mode is not None and mode != chosen:
        chosen, reason = mode, f"{mode} requested ({reason})"
    if chosen == BIT_FOR_BIT:
        findings, problems = _bit_for_bit(shipped, rebuilt)
    else:
        findings, problems = _within_tolerance(shipped_root, rebuilt_root, shipped, rebuilt, tolerances)
    where = f"{name}/{version}"
    return RebuildCheck(name, version, chosen, reason, tuple(findings), tuple(f"{where}: {p}" for p in problems))


def _bit_for_bit(shipped: Manifest, rebuilt: Manifest) -> tuple[list[str], list[str]]:
    problems = []
    if rebuilt.weights.sha256 != shipped.weights.sha256:
        problems.append(f"rebuilt weights sha256 {rebuilt.weights.sha256} != shipped {shipped.weights.sha256}")
    if _produced(rebuilt) != _produced(shipped):
        problems.append(f"rebuilt manifest differs from the shipped one (beyond {', '.join(RUN_FIELDS)})")
    same = "identical" if rebuilt.weights.sha256 == shipped.weights.sha256 else "different"
    findings = [f"weights sha256 {rebuilt.weights.sha256[:16]}…, {same} to the shipped one; "
                f"manifest compared but for {', '.join(RUN_FIELDS)}"]
    return findings, problems


def _produced(manifest: Manifest) -> dict[str, Any]:
    """The manifest as JSON data, without the fields a bit-identical rebuild may still change."""
    data: dict[str, Any] = json.loads(json.dumps(asdict(manifest), default=str))
    data["quality"] = {k: v for k, v in data["quality"].items() if k not in RUN_FIELDS}
    return data


def _structure(manifest: Manifest) -> dict[str, Any]:
    """What any rebuild of the recipe must reproduce exactly: all but the trained numbers and their provenance."""
    data = _produced(manifest)
    data["weights"].pop("sha256")
    data["quality"] = {k: v for k, v in data["quality"].items() if k in _QUALITY_EXACT}
    data["build"] = {k: v for k, v in data["build"].items() if k not in PLATFORM_KEYS}
    for spec in ("classifier", "generator"):
        if data.get(spec):
            data[spec].pop("golden")  # checked by running them (see _goldens)
    return data


def _within_tolerance(shipped_root: Path, rebuilt_root: Path, shipped: Manifest, rebuilt: Manifest,
                      tol: Tolerances) -> tuple[list[str], list[str]]:
    findings: list[str] = []
    problems: list[str] = []
    if _structure(rebuilt) != _structure(shipped):
        problems.append("rebuilt manifest differs from the shipped one beyond weights, quality, goldens "
                        "and platform (architecture, envelope, inputs or recipe)")
    findings_w, problems_w = _weights(shipped_root / shipped.name / shipped.version / shipped.weights.file,
                                      rebuilt_root / rebuilt.name / rebuilt.version / rebuilt.weights.file,
                                      tol.weights_relative_l2)
    findings += findings_w
    problems += problems_w
    for key, tol_field in _QUALITY_TOLERANCE.items():
        if key not in shipped.quality and key not in rebuilt.quality:
            continue
        limit = getattr(tol, tol_field)
        was, now = shipped.quality.get(key, math.nan), rebuilt.quality.get(key, math.nan)
        delta = abs(now - was)
        findings.append(f"{key} {now:.4f} vs shipped {was:.4f} (|diff| {delta:.4f}, tolerance {limit})")
        if not delta <= limit:  # NaN (missing) fails too
            problems.append(f"{key} {now:.4f} is more than {limit} from the shipped {was:.4f}")
    findings_g, problems_g = _goldens(shipped_root, shipped, rebuilt_root, tol)
    return findings + findings_g, problems + problems_g


def _weights(shipped_path: Path, rebuilt_path: Path, limit: float) -> tuple[list[str], list[str]]:
    try:
        shipped = torch.load(shipped_path, map_location="cpu", weights_only=True)
        rebuilt = torch.load(rebuilt_path, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged file is a finding, not a crash of the verifier
        return [], [f"cannot load the weights to compare them: {e}"]
    if not isinstance(shipped, dict) or not isinstance(rebuilt, dict):
        return [], ["weights are not a state dict"]
    if shipped.keys() != rebuilt.keys():
        return [], [f"weight tensors differ by name: {sorted(set(shipped) ^ set(rebuilt))}"]
    problems = []
    worst_name, worst = "", 0.0
    for key, want in shipped.items():
        got = rebuilt[key]
        if got.shape != want.shape or got.dtype != want.dtype:
            problems.append(f"weight {key}: {got.dtype}{list(got.shape)} != shipped {want.dtype}{list(want.shape)}")
            continue
        if not want.is_floating_point():
            if not torch.equal(got, want):
                problems.append(f"weight {key}: integer tensor differs")
            continue
        relative = relative_l2(got, want)
        if relative > worst or math.isnan(relative):
            worst_name, worst = key, relative
        if not relative <= limit:
            problems.append(f"weight {key}: relative L2 difference {relative:.4f} > {limit}")
    findings = [f"weights: {len(shipped)} tensors, same names, shapes and dtypes; largest relative L2 "
                f"difference {worst:.3g} ({worst_name or 'every tensor equal'}), tolerance {limit}"] if not problems else []
    return findings, problems


def relative_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (0 for two zero tensors, inf when only `want` is zero)."""
    diff = float((got.double() - want.double()).norm())
    scale = float(want.double().norm())
    if scale == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / scale


def _goldens(shipped_root: Path, shipped: Manifest, rebuilt_root: Path,
             tol: Tolerances) -> tuple[list[str], list[str]]:
    """Run the shipped manifest's golden inputs through the rebuilt model and compare the outputs."""
    try:
        model = load_model(rebuilt_root, shipped.name, shipped.version)
    except ModelRepositoryError as e:
        return [], [f"the rebuilt model does not load: {e}"]
    m = model.manifest
    if m.classifier is not None and shipped.classifier is not None:
        m = dataclasses.replace(m, classifier=dataclasses.replace(m.classifier, golden=shipped.classifier.golden))
        try:
            run_golden_check(dataclasses.replace(model, manifest=m))
        except GoldenCheckFailed as e:
            return [], [f"the rebuilt model's golden outputs differ from the shipped ones: {e}"]
        return [f"{len(shipped.classifier.golden)} golden images: top-1 identical to the shipped ones"], []
    if m.generator is not None and shipped.generator is not None:
        return _generator_goldens(load_model(shipped_root, shipped.name, shipped.version).generator,
                                  model.generator, shipped.generator.golden, tol.golden_decisive_logit_gap)
    return [], ["the rebuilt model is not of the shipped kind"]


def _generator_goldens(shipped: Generator, rebuilt: Generator, goldens: Sequence[GoldenGeneration],
                       decisive_gap: float) -> tuple[list[str], list[str]]:
    """Teacher-forced: at each golden position the rebuilt model's top-1 must be the shipped token
    wherever the shipped model was decisive (top-1 logit ahead of the runner-up by `decisive_gap`).

    A near-tie's winner is decided by rounding, not by the recipe; free-running greedy decoding
    turns one such flip into a different continuation, so it is reported, not required.
    """
    problems = []
    num_positions = num_agree = num_decisive = 0
    greedy_identical = 0
    for i, golden in enumerate(goldens):
        ids = [*golden.prompt_ids, *golden.expected_ids]
        first = len(golden.prompt_ids) - 1  # the logits at this position chose expected_ids[0]
        want_logits = shipped.dense_logits(ids[:-1])[first:].float()
        got_top1 = rebuilt.dense_logits(ids[:-1])[first:].argmax(dim=-1).tolist()
        top2 = want_logits.topk(2, dim=-1).values
        gaps = (top2[:, 0] - top2[:, 1]).tolist()
        for j, (want, got, gap) in enumerate(zip(golden.expected_ids, got_top1, gaps, strict=True)):
            num_positions += 1
            num_agree += got == want
            if gap >= decisive_gap:
                num_decisive += 1
                if got != want:
                    problems.append(f"golden prompt {i}, token {j}: the rebuilt model's top-1 is {got}, the "
                                    f"shipped token {want} (which led by {gap:.3f} logits)")
        greedy = rebuilt.greedy_dense(golden.prompt_ids, len(golden.expected_ids))
        greedy_identical += tuple(greedy) == golden.expected_ids
    findings = [f"{len(goldens)} golden prompts, teacher-forced: top-1 equals the shipped token at {num_agree} of "
                f"{num_positions} positions, at all {num_decisive} where the shipped model led by >= "
                f"{decisive_gap} logits" if not problems else
                f"{len(goldens)} golden prompts, teacher-forced: top-1 equals the shipped token at {num_agree} of "
                f"{num_positions} positions",
                f"free-running greedy continuations identical to the shipped ones: {greedy_identical} of {len(goldens)}"]
    return findings, problems
