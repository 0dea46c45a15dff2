"""The comparison a rebuild gets (tools/rebuild_check.py): which one, and a generator's goldens."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from services.worker.models.generator import Generator
from services.worker.models.transformer import DecoderLM, TransformerConfig
from services.worker.repository.generator_spec import GoldenGeneration
from services.worker.repository.manifest import Manifest
from services.worker.repository.store import load_manifest
from tools.rebuild_check import BIT_FOR_BIT, TOLERANCE, _generator_goldens, choose_mode, relative_l2

SHIPPED_ROOT = Path(__file__).resolve().parents[3] / "model_repo"
ELSEWHERE = {"torch": "2.13.0+cpu", "numpy": "2.4.6", "aten_cpu_capability": "AVX512",
             "onednn_isa": "Intel AVX-512 with Intel AMX", "cpu": "GenuineIntel family 6 model 167: Xeon",
             "mkl_env": "unset"}
TINY = TransformerConfig(vocab_size=16, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, d_ff=32)


def on_platform(manifest: Manifest, platform: dict[str, str]) -> Manifest:
    return dataclasses.replace(manifest, build={**manifest.build, **platform})


def tiny_generator(seed: int) -> Generator:
    torch.manual_seed(seed)
    return Generator(DecoderLM(TINY).eval(), max_seq_len=64, eos_token_id=15, bos_token_id=14)


def goldens_of(generator: Generator) -> list[GoldenGeneration]:
    prompts = [(14, 1, 2, 3), (14, 7)]
    return [GoldenGeneration(p, tuple(generator.greedy_dense(p, 12))) for p in prompts]


def test_the_comparison_is_bit_for_bit_only_on_the_recorded_platform():
    shipped = on_platform(load_manifest(SHIPPED_ROOT, "digits", "1"), ELSEWHERE)
    mode, reason = choose_mode(shipped, shipped)
    assert mode == BIT_FOR_BIT and "AVX512" in reason
    elsewhere = on_platform(shipped, {"aten_cpu_capability": "AVX2"})
    mode, reason = choose_mode(shipped, elsewhere)
    assert mode == TOLERANCE and "aten_cpu_capability 'AVX2' != recorded 'AVX512'" in reason
    unrecorded = dataclasses.replace(shipped, build={"recipe_sha256": shipped.build["recipe_sha256"]})
    assert choose_mode(unrecorded, shipped)[0] == TOLERANCE


def test_relative_l2():
    want = torch.tensor([3.0, 4.0])
    assert relative_l2(want.clone(), want) == 0.0
    assert relative_l2(torch.tensor([3.0, 4.5]), want) == 0.1
    assert relative_l2(torch.zeros(2), torch.zeros(2)) == 0.0
    assert relative_l2(torch.ones(2), torch.zeros(2)) == math.inf


def test_a_generator_reproducing_its_goldens_passes_and_says_how():
    shipped = tiny_generator(0)
    findings, problems = _generator_goldens(shipped, tiny_generator(0), goldens_of(shipped), decisive_gap=1.0)
    assert problems == []
    assert "top-1 equals the shipped token at 24 of 24 positions" in findings[0]
    assert findings[1] == "free-running greedy continuations identical to the shipped ones: 2 of 2"


def test_a_near_tie_may_flip_but_a_decisive_golden_token_may_not():
    shipped, other = tiny_generator(0), tiny_generator(1)
    goldens = goldens_of(shipped)
    # An untrained model's logits are near ties everywhere: with no position decisive, nothing is required...
    _, problems = _generator_goldens(shipped, other, goldens, decisive_gap=math.inf)
    assert problems == []
    # ...and with every position decisive, another model's top-1 choices are caught.
    findings, problems = _generator_goldens(shipped, other, goldens, decisive_gap=0.0)
    assert problems and all("the rebuilt model's top-1 is" in p for p in problems)
    assert "free-running greedy continuations identical to the shipped ones" in findings[-1]
