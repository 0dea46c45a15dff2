"""Serving LoRA adapters on a worker: the --lora-adapters flag, and a step naming an adapter the worker
does not serve failing that sequence alone, naming it."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError
from services.worker.config import WorkerConfig, parse_lora_adapters
from services.worker.models.generator import Generator
from services.worker.models.llama_weights import load_llama_family, read_config
from services.worker.models.lora import load_lora_adapter
from services.worker.step_executor import StepExecutor
from services.worker.work import ErrorCode, RunStep, SequenceStep
from tests.support.hf_checkpoints import save_tiny_checkpoint
from tests.support.lora_adapters import save_lora_adapter


def test_lora_adapters_flag_reads_names_and_directories():
    assert parse_lora_adapters(" a=/x , b.2=/y") == (("a", "/x"), ("b.2", "/y"))
    assert parse_lora_adapters("") == ()
    for bad, said in (("a", "name=DIR"), ("=/x", "name=DIR"), ("a=/x,a=/y", "twice"), ("a b=/x", "name=DIR")):
        with pytest.raises(ValueError, match=said):
            parse_lora_adapters(bad)
    with pytest.raises(ConfigError, match="named as the model"):
        WorkerConfig(model_name="m", lora_adapters="m=/x")


def test_a_step_naming_an_unserved_adapter_fails_that_sequence_alone(tmp_path):
    base = tmp_path / "base"
    save_tiny_checkpoint(base, "llama")
    generator = Generator(load_llama_family(base), max_seq_len=64, eos_token_id=2, bos_token_id=1)
    generator.add_lora(load_lora_adapter("a", save_lora_adapter(tmp_path / "a", base), read_config(base)))
    executor = StepExecutor(generator, num_kv_blocks=8, block_size=4)
    seqs = tuple(SequenceStep(seq_id=i, token_ids=(5, 6, 7), start_position=0, new_blocks=(i,),
                              reset_block_table=True, sample=True, lora_adapter=name)
                 for i, name in enumerate(("", "a", "nope")))
    outputs, _ = executor.run(RunStep(step_id=1, seqs=seqs))
    assert [o.token_id is not None for o in outputs] == [True, True, False]
    error = outputs[2].error
    assert error is not None and error.code is ErrorCode.INVALID_ARGUMENT and "'nope'" in error.message
