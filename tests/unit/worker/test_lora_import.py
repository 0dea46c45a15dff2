"""`infermesh models import DIR --lora NAME=ADAPTER_DIR`: adapters pinned in the repository version by
sha256, checked before anything is written, verified before they are read, served by the loaded model."""

from __future__ import annotations

import json

import pytest
import torch

from services.worker.models.paged import PagedSequence
from services.worker.repository.errors import ChecksumMismatch, ImportRefused, InvalidManifest
from services.worker.repository.hf_import import ImportOptions, import_checkpoint
from services.worker.repository.loader import load_model
from services.worker.repository.store import sha256_of
from tests.support.hf_checkpoints import save_model_directory
from tests.support.lora_adapters import adapter_tensor, save_lora_adapter


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lora-import") / "base"
    save_model_directory(directory, "llama")
    save_lora_adapter(directory.parent / "sql", directory, seed=1)
    return directory


def _import(checkpoint, root, *adapters):
    return import_checkpoint(checkpoint, root, ImportOptions("m", "1", kv_cache_bytes=1 << 20,
                                                             lora_adapters=tuple(adapters)))


def test_import_pins_the_adapter_and_the_loaded_model_serves_it(checkpoint, tmp_path):
    adapter = checkpoint.parent / "sql"
    manifest = _import(checkpoint, tmp_path, ("sql", str(adapter)))
    spec = manifest.generator
    assert spec is not None
    (pin,) = spec.lora_adapters
    version = tmp_path / "m" / "1"
    assert (pin.name, pin.config.file, pin.weights.file) == (
        "sql", "lora.sql.adapter_config.json", "lora.sql.adapter_model.safetensors")
    assert pin.weights.sha256 == sha256_of(adapter / "adapter_model.safetensors") == sha256_of(version / pin.weights.file)
    written = json.loads((version / "manifest.json").read_text())["generator"]["lora_adapters"]
    assert written == [pin.to_json()]

    generator = load_model(tmp_path, "m", "1").generator
    assert generator.lora is not None and generator.lora.names == ("sql",)
    cache = generator.new_kv_cache(4, 4)
    seqs = [PagedSequence((5, 6, 7), 0, (0,), True), PagedSequence((5, 6, 7), 0, (1,), True, adapter="sql")]
    base, adapted = generator.step(seqs, cache)
    assert not torch.allclose(base, adapted)


def test_a_modified_adapter_file_is_refused_before_it_is_read(checkpoint, tmp_path):
    _import(checkpoint, tmp_path, ("sql", str(checkpoint.parent / "sql")))
    path = tmp_path / "m" / "1" / "lora.sql.adapter_config.json"
    path.write_text(path.read_text().replace('"lora_alpha": 8.0', '"lora_alpha": 80.0'))
    with pytest.raises(ChecksumMismatch, match="LoRA adapter 'sql'"):
        load_model(tmp_path, "m", "1")


def test_an_adapter_the_model_cannot_serve_is_refused_and_nothing_is_written(checkpoint, tmp_path):
    bad = save_lora_adapter(tmp_path / "bad", checkpoint, rank=4)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "r": 2}))
    with pytest.raises(ImportRefused, match=adapter_tensor(0, "q_proj", "A").replace(".", r"\.")):
        _import(checkpoint, tmp_path / "repo", ("bad", str(bad)))
    for name in ("m", "a/b"):
        with pytest.raises(ImportRefused, match="--lora"):
            _import(checkpoint, tmp_path / "repo", (name, str(checkpoint.parent / "sql")))
    assert not (tmp_path / "repo" / "m" / "1").exists()


def test_a_manifest_naming_an_adapter_twice_is_refused(checkpoint, tmp_path):
    _import(checkpoint, tmp_path, ("sql", str(checkpoint.parent / "sql")))
    path = tmp_path / "m" / "1" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["generator"]["lora_adapters"] *= 2
    path.write_text(json.dumps(manifest))
    with pytest.raises(InvalidManifest, match="lora_adapters"):
        load_model(tmp_path, "m", "1")


def test_golden_cases_are_recorded_under_each_adapter_and_checked_at_load(checkpoint, tmp_path):
    from services.worker.repository.errors import GoldenCheckFailed
    from services.worker.repository.golden import run_golden_check

    manifest = _import(checkpoint, tmp_path, ("sql", str(checkpoint.parent / "sql")))
    spec = manifest.generator
    assert spec is not None
    by_adapter = {g.lora_adapter for g in spec.golden}
    assert by_adapter == {"", "sql"}
    run_golden_check(load_model(tmp_path, "m", "1"))
    # The adapter's cases differ from the base's (else the check below would prove nothing); stripped of
    # their adapter, so checked against the base model, they fail.
    sql = [g.expected_ids for g in spec.golden if g.lora_adapter == "sql"]
    assert sql != [g.expected_ids for g in spec.golden if not g.lora_adapter]
    path = tmp_path / "m" / "1" / "manifest.json"
    data = json.loads(path.read_text())
    for case in data["generator"]["golden"]:
        case.pop("lora_adapter", None)
    path.write_text(json.dumps(data))
    with pytest.raises(GoldenCheckFailed, match=r"golden prompt \d+ continued"):
        run_golden_check(load_model(tmp_path, "m", "1"))
