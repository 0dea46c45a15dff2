"""`infermesh models import`: a file becomes a golden-checked version, or a refusal naming the flag (exit 2)."""

from __future__ import annotations

import json

import pytest

from services.cli import main as cli
from tests.support.tensor_models import MLP, SEQ, export_onnx, export_torchscript


def test_an_onnx_file_is_imported_with_what_its_graph_says(tmp_path, capsys):
    source = export_onnx(SEQ, tmp_path)
    code = cli.main(["models", "import", str(source), "--name", "seq", "--version", "3",
                     "--repository", str(tmp_path / "repo"), "--preferred-batch-sizes", "2,4"])
    assert code == 0, capsys.readouterr().err
    manifest = json.loads((tmp_path / "repo" / "seq" / "3" / "manifest.json").read_text())
    assert manifest["kind"] == "tensor" and manifest["tensor"]["format"] == "onnx"
    assert manifest["tensor"]["inputs"] == [{"name": "tokens", "datatype": "INT64", "dims": [-1, -1]}]
    assert manifest["tensor"]["preferred_batch_sizes"] == [2, 4]
    assert (tmp_path / "repo" / "seq" / "3" / "seq.onnx").read_bytes() == source.read_bytes()
    assert "imported seq.onnx as seq/3" in capsys.readouterr().out


def test_torchscript_needs_its_inputs_and_the_refusal_names_the_flag(tmp_path, capsys):
    source = export_torchscript(MLP, tmp_path)
    repo = str(tmp_path / "repo")
    assert cli.main(["models", "import", str(source), "--name", "mlp", "--version", "1", "--repository", repo]) == 2
    assert "give each with --input NAME:DATATYPE:DIMS" in capsys.readouterr().err
    code = cli.main(["models", "import", str(source), "--name", "mlp", "--version", "1", "--repository", repo,
                     "--input", "a:FP32:-1,4", "--input", "b:FP32:-1,3", "--output", "y", "--output", "norm"])
    assert code == 0, capsys.readouterr().err
    manifest = json.loads((tmp_path / "repo" / "mlp" / "1" / "manifest.json").read_text())
    assert [o["name"] for o in manifest["tensor"]["outputs"]] == ["y", "norm"]


def test_what_is_not_a_model_file_is_refused(tmp_path, capsys):
    assert cli.main(["models", "import", str(tmp_path), "--name", "m", "--version", "1"]) == 2
    assert "not a model this command imports" in capsys.readouterr().err
    assert cli.main(["models", "import", str(tmp_path / "none.onnx"), "--name", "m", "--version", "1"]) == 2
    assert "no such file or directory" in capsys.readouterr().err


def test_an_image_input_needs_mean_and_std(tmp_path, capsys):
    source = export_onnx(MLP, tmp_path)
    assert cli.main(["models", "import", str(source), "--name", "m", "--version", "1", "--image-input", "a"]) == 2
    assert "--image-input needs --image-mean and --image-std" in capsys.readouterr().err


def test_a_checkpoints_reasoning_parser_is_told_from_its_template_and_none_switches_it_off(tmp_path, capsys):
    from tests.support.hf_checkpoints import save_model_directory
    from tests.support.reasoning_templates import QWEN3

    save_model_directory(tmp_path / "ckpt", "qwen2", chat_template=QWEN3)
    repo = str(tmp_path / "repo")
    for version, flags in (("1", []), ("2", ["--reasoning-parser", "none"]),
                           ("3", ["--reasoning-parser", "deepseek_r1"])):
        code = cli.main(["models", "import", str(tmp_path / "ckpt"), "--name", "think", "--version", version,
                         "--repository", repo, "--kv-cache-gb", "0.001", *flags])
        assert code == 0, capsys.readouterr().err
    said = capsys.readouterr().out.splitlines()  # each import says what it recorded, on its second line
    assert [line for line in said if line.startswith("Qwen2ForCausalLM;")] == [
        f"Qwen2ForCausalLM; tool-call parser: hermes; reasoning parser: {parser}; recommended sampling: none"
        for parser in ("qwen3", "none", "deepseek_r1")]
    recorded = [json.loads((tmp_path / "repo" / "think" / v / "manifest.json").read_text())["generator"]["tokenizer"]
                .get("reasoning_parser") for v in ("1", "2", "3")]
    assert recorded == ["qwen3", None, "deepseek_r1"]
    with pytest.raises(SystemExit) as exited:  # argparse's refusal of a choice it does not list
        cli.main(["models", "import", str(tmp_path / "ckpt"), "--name", "think", "--version", "4",
                  "--repository", repo, "--reasoning-parser", "granite"])
    assert exited.value.code == 2
    assert "--reasoning-parser: invalid choice: 'granite'" in capsys.readouterr().err


def test_an_awq_or_gptq_checkpoint_is_imported_and_said_to_be_dequantized(tmp_path, capsys):
    """The directory as AutoGPTQ publishes it; the import passes the worker's golden check and says what
    the weights are and what they cost once dequantized (an unquantized checkpoint gets no such line)."""
    import torch

    from tests.support.awq_gptq_checkpoints import IntScheme, quantize_checkpoint
    from tests.support.hf_checkpoints import save_model_directory

    save_model_directory(tmp_path / "ckpt", "qwen2", dtype=torch.float16)
    quantize_checkpoint(tmp_path / "ckpt", IntScheme("gptq", desc_act=True))
    code = cli.main(["models", "import", str(tmp_path / "ckpt"), "--name", "q", "--version", "1",
                     "--repository", str(tmp_path / "repo"), "--kv-cache-gb", "0.001"])
    assert code == 0, capsys.readouterr().err
    said = capsys.readouterr().out.splitlines()
    assert said[-1].startswith("weights: gptq 4-bit, group_size 32, act-order (v1 zeros), dequantized at load: "
                               "the worker holds the unquantized model, 0.00 GiB in float32"), said
    pinned = json.loads((tmp_path / "repo" / "q" / "1" / "config.json").read_text())
    assert pinned["quantization_config"]["quant_method"] == "gptq"


def test_lora_adapters_are_pinned_and_a_malformed_flag_is_refused(tmp_path, capsys):
    from tests.support.hf_checkpoints import save_model_directory
    from tests.support.lora_adapters import save_lora_adapter

    base = tmp_path / "base"
    save_model_directory(base, "llama")
    adapter = save_lora_adapter(tmp_path / "sql", base)
    repo = str(tmp_path / "repo")
    flags = ["models", "import", str(base), "--name", "m", "--version", "1", "--repository", repo, "--kv-cache-gb", "0.01"]
    assert cli.main([*flags, "--lora", str(adapter)]) == 2
    assert "--lora" in capsys.readouterr().err and not (tmp_path / "repo" / "m" / "1").exists()
    assert cli.main([*flags, "--lora", f"sql={adapter}"]) == 0, capsys.readouterr().err
    assert "LoRA adapters, each served as a model of its own over m: sql" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "repo" / "m" / "1" / "manifest.json").read_text())
    assert [a["name"] for a in manifest["generator"]["lora_adapters"]] == ["sql"]
