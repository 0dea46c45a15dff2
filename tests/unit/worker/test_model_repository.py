from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from services.common.errors import NotFound
from services.worker.models.classifier import Classifier
from services.worker.models.generator import Generator
from services.worker.repository.errors import ChecksumMismatch, GoldenCheckFailed, InvalidManifest
from services.worker.repository.generator_spec import GoldenGeneration
from services.worker.repository.golden import GOLDEN_CHECKS, run_golden_check
from services.worker.repository.loader import FILE_RUNTIME_BUILDERS, RUNTIME_BUILDERS, LoadedModel, load_model
from services.worker.repository.manifest import KINDS, ModelKind, manifest_to_dict, parse_manifest
from services.worker.repository.store import (
    ModelVersion,
    list_models,
    load_manifest,
    sha256_of,
    verified_file,
)
from tools.build_models import DigitsRecipe, build_digits


def _copy_version(model_root: Path, tmp_path: Path, name: str) -> Path:
    shutil.copytree(model_root / name / "1", tmp_path / name / "1")
    return tmp_path


def test_lists_every_built_version(model_root: Path) -> None:
    found = list_models(model_root)
    assert ModelVersion("digits", "1") in found
    assert ModelVersion("tinylm", "1") in found


def test_loads_both_kinds_with_their_envelopes(digits: LoadedModel, tinylm: LoadedModel) -> None:
    assert digits.manifest.kind is ModelKind.CLASSIFIER
    assert isinstance(digits.classifier, Classifier)
    assert digits.classifier.labels == tuple(str(d) for d in range(10))
    assert digits.manifest.envelope.max_batch_size >= 1
    assert tinylm.manifest.kind is ModelKind.GENERATOR
    assert isinstance(tinylm.generator, Generator)
    tok = tinylm.manifest.generator.tokenizer
    assert (tok.kind, tok.vocab_size, tok.eos_token_id, tok.bos_token_id) == ("bytes", 258, 256, 257)
    env = tinylm.manifest.envelope
    assert env.num_kv_blocks * env.block_size >= tinylm.manifest.generator.max_seq_len
    with pytest.raises(ValueError, match="is a classifier"):
        _ = digits.generator


def test_digits_manifest_records_heldout_accuracy_of_at_least_95_percent(digits: LoadedModel) -> None:
    assert digits.manifest.quality["heldout_accuracy"] >= 0.95


def test_golden_check_passes_on_built_models(digits: LoadedModel, tinylm: LoadedModel) -> None:
    run_golden_check(digits)
    run_golden_check(tinylm)


def test_golden_check_fails_on_a_wrong_classifier_expectation(digits: LoadedModel) -> None:
    spec = digits.manifest.classifier
    wrong = dataclasses.replace(spec.golden[0], expected_top1=(spec.golden[0].expected_top1 + 1) % 10)
    manifest = dataclasses.replace(
        digits.manifest, classifier=dataclasses.replace(spec, golden=(wrong, *spec.golden[1:]))
    )
    with pytest.raises(GoldenCheckFailed, match="digits/1: golden images classified as"):
        run_golden_check(LoadedModel(manifest, digits.path, digits.runtime))


def test_golden_check_fails_on_a_wrong_generator_expectation(tinylm: LoadedModel) -> None:
    spec = tinylm.manifest.generator
    golden = spec.golden[0]
    expected = list(golden.expected_ids)
    expected[-1] = (expected[-1] + 1) % 256
    manifest = dataclasses.replace(
        tinylm.manifest,
        generator=dataclasses.replace(spec, golden=(GoldenGeneration(golden.prompt_ids, tuple(expected)),)),
    )
    with pytest.raises(GoldenCheckFailed, match="tinylm/1: golden prompt 0 continued as"):
        run_golden_check(LoadedModel(manifest, tinylm.path, tinylm.runtime))


def test_tampered_weights_are_refused_naming_the_file_and_both_digests(model_root: Path, tmp_path: Path) -> None:
    root = _copy_version(model_root, tmp_path, "digits")
    weights = root / "digits" / "1" / "weights.pt"
    expected = sha256_of(weights)
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    actual = sha256_of(weights)
    with pytest.raises(ChecksumMismatch) as caught:
        load_model(root, "digits", "1")
    message = caught.value.message
    assert str(weights) in message and expected in message and actual in message


def test_unknown_versions_and_latest_are_not_found(model_root: Path) -> None:
    with pytest.raises(NotFound, match="digits/7 not found"):
        load_manifest(model_root, "digits", "7")
    with pytest.raises(NotFound, match="no 'latest' version"):
        load_model(model_root, "digits", "latest")
    with pytest.raises(NotFound, match="not a valid repository name"):
        load_model(model_root, "../etc", "1")


def test_manifest_round_trips_through_json(digits: LoadedModel, tinylm: LoadedModel) -> None:
    for model in (digits, tinylm):
        data = json.loads(json.dumps(manifest_to_dict(model.manifest)))
        assert parse_manifest(data, source="mem") == model.manifest


def _mutations() -> list[tuple[str, str, object]]:
    """(description, dotted path to set or delete ("-" prefix), value) and the expected message fragment."""
    return [
        ("-classifier.labels", None, "missing field 'classifier.labels'"),
        ("kind", "regressor", "field 'kind' must be 'classifier' or 'generator'"),
        ("version", "latest", "'latest' is not allowed"),
        ("weights.sha256", "abc", "field 'weights.sha256' must match"),
        ("weights.file", "../weights.pt", "plain file name"),
        ("classifier.inputs.std", [0.5, 0.0, 0.5], "field 'classifier.inputs.std' entries must be > 0"),
        ("classifier.inputs.mean", [0.5], "field 'classifier.inputs.mean' must be 3 numbers"),
        ("classifier.labels", ["0", "1"], "has 2 entries but architecture.num_classes is 10"),
        ("classifier.architecture.input_height", 15, "divisible"),
        ("classifier.golden.0.pixels_b64", "AAAA", "decodes to 3 bytes"),
        ("classifier.golden.0.expected_top1", 10, "must be < num_classes 10"),
        ("envelope.max_batch_size", 0, "field 'envelope.max_batch_size' must be an integer >= 1"),
        ("surprise", 1, "unknown field(s) ['surprise']"),
        ("generator", {}, "field 'generator' must be absent for a classifier"),
        ("format_version", 2, "field 'format_version' must be 1"),
    ]


def _apply(data: dict, path: str, value: object) -> None:
    delete = path.startswith("-")
    keys = path.lstrip("-").split(".")
    target = data
    for key in keys[:-1]:
        target = target[int(key)] if isinstance(target, list) else target[key]
    if delete:
        del target[keys[-1]]
    else:
        target[keys[-1]] = value


@pytest.mark.parametrize(("path", "value", "fragment"), _mutations(), ids=[m[0] for m in _mutations()])
def test_bad_manifests_are_rejected_naming_the_field(
    digits: LoadedModel, path: str, value: object, fragment: str
) -> None:
    data = copy.deepcopy(manifest_to_dict(digits.manifest))
    _apply(data, path, value)
    with pytest.raises(InvalidManifest) as caught:
        parse_manifest(data, source="digits/1/manifest.json")
    assert caught.value.message.startswith("digits/1/manifest.json: ")
    assert fragment in caught.value.message


def test_generator_manifest_must_fit_one_sequence_in_its_kv_blocks(tinylm: LoadedModel) -> None:
    data = manifest_to_dict(tinylm.manifest)
    data["envelope"]["num_kv_blocks"] = 1
    max_seq_len = tinylm.manifest.generator.max_seq_len
    with pytest.raises(InvalidManifest, match=f"fewer than one sequence of max_seq_len {max_seq_len}"):
        parse_manifest(data, source="m")


def test_manifest_that_is_not_json_or_names_another_version_is_rejected(model_root: Path, tmp_path: Path) -> None:
    root = _copy_version(model_root, tmp_path, "digits")
    manifest_path = root / "digits" / "1" / "manifest.json"
    data = json.loads(manifest_path.read_text())
    shutil.copytree(root / "digits" / "1", root / "digits" / "2")
    with pytest.raises(InvalidManifest, match="manifest says digits/1 but lives in digits/2"):
        load_manifest(root, "digits", "2")
    manifest_path.write_text(json.dumps(data)[:-5])
    with pytest.raises(InvalidManifest, match="not valid JSON"):
        load_manifest(root, "digits", "1")
    manifest_path.write_text("[" * 100_000)  # past json's recursion: a RecursionError out of the worker's load before
    with pytest.raises(InvalidManifest, match="not valid JSON"):
        load_manifest(root, "digits", "1")


def test_build_skips_an_up_to_date_version(model_root: Path, digits: LoadedModel) -> None:
    result = build_digits(model_root, DigitsRecipe(), log=lambda _: None)
    assert result.built is False
    assert load_manifest(model_root, "digits", "1").weights == digits.manifest.weights


def test_every_kind_has_a_block_schema_a_runtime_builder_a_golden_check_and_an_attach_runtime() -> None:
    from services.worker.model_runtime import SERVING_RUNTIMES

    assert set(KINDS) == {kind.value for kind in ModelKind}
    # A kind builds from a state_dict (RUNTIME_BUILDERS) or from a whole model file (FILE_RUNTIME_BUILDERS), never both.
    assert not set(RUNTIME_BUILDERS) & set(FILE_RUNTIME_BUILDERS)
    built = set(RUNTIME_BUILDERS) | set(FILE_RUNTIME_BUILDERS)
    assert built == set(GOLDEN_CHECKS) == set(SERVING_RUNTIMES) == set(ModelKind)


@pytest.mark.parametrize(("path", "value", "fragment"), [
    ("generator.tokenizer.kind", "sentencepiece",
     "field 'generator.tokenizer.kind' must be 'bytes' or 'hf' (the tokenizers this worker serves), got 'sentencepiece'"),
    ("generator.tokenizer.merges", [], "unknown field(s) ['merges'] in generator.tokenizer"),
    ("weights.format", "safetensors", "unknown field(s) ['file', 'sha256'] in weights"),  # its own schema: files, index
    ("weights.format", "torch", "unknown field(s) ['format'] in weights"),  # the torch block is written without it
    ("classifier", {}, "field 'classifier' must be absent for a generator"),
])
def test_bad_generator_manifests_are_rejected_naming_the_field(
    tinylm: LoadedModel, path: str, value: object, fragment: str
) -> None:
    data = copy.deepcopy(manifest_to_dict(tinylm.manifest))
    _apply(data, path, value)
    with pytest.raises(InvalidManifest) as caught:
        parse_manifest(data, source="tinylm/1/manifest.json")
    assert fragment in caught.value.message


def test_a_manifest_holds_the_block_of_its_kind_alone(digits: LoadedModel, tinylm: LoadedModel) -> None:
    with pytest.raises(ValueError, match=r"holds the classifier block alone, got \['classifier', 'generator'\]"):
        dataclasses.replace(digits.manifest, generator=tinylm.manifest.generator)
    with pytest.raises(ValueError, match=r"got \[\]"):
        dataclasses.replace(digits.manifest, classifier=None)
    assert digits.manifest.spec is digits.manifest.classifier


def test_a_pinned_file_is_returned_only_when_present_with_its_sha256(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes(b"{}")
    digest = sha256_of(tmp_path / "tokenizer.json")
    assert verified_file(tmp_path, "tokenizer.json", digest, "tokenizer") == tmp_path / "tokenizer.json"
    with pytest.raises(ChecksumMismatch, match=f"tokenizer file {tmp_path}/tokenizer.json has sha256 {digest} "
                                               f"but the manifest expects {'0' * 64}"):
        verified_file(tmp_path, "tokenizer.json", "0" * 64, "tokenizer")
    with pytest.raises(InvalidManifest, match="tokenizer file .*/merges.txt is missing"):
        verified_file(tmp_path, "merges.txt", digest, "tokenizer")
