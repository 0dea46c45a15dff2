"""LoRA adapters served through the whole mesh (gateway -> scheduler -> worker, real processes).

A tiny Llama checkpoint is imported as `tiny-lora:1` with one PEFT adapter pinned in the version
(`infermesh models import ... --lora ad-x=DIR`) and served by one worker given another
(`--lora-adapters ad-y=DIR`). The gateway lists each adapter as a model whose `parent` is the
base; greedy tokens of the base and of both adapters, requested together (so their sequences share
steps, and the same prompt's blocks are cached under each), equal each model alone: the base model's
own and the merged-weight model's (`W + scale * B @ A`, merged by tests/support/lora_adapters) for each
adapter. An adapter no worker serves is a 404 naming it.

Greedy decoding compares argmaxes: each prompt is compared up to the reference's first near tie (top
two within MIN_MARGIN), and almost all tokens must be compared.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.worker.models.generator import Generator
from services.worker.models.llama_weights import load_llama_family
from services.worker.repository.hf_import import ImportOptions, import_checkpoint
from tests.support.hf_checkpoints import save_model_directory
from tests.support.lora_adapters import save_lora_adapter, save_merged_checkpoint
from tools.testbed import session_tls
from tools.testbed.processes import free_port, running_mesh, wait_all_serving, wait_until

pytestmark = pytest.mark.integration

MODEL = "tiny-lora"
ADAPTERS = {"ad-x": dict(targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                         seed=1, rank=4, alpha=8),
            "ad-y": dict(targets=("q_proj", "v_proj"), seed=2, rank=8, alpha=16, use_rslora=True)}
NUM_NEW_TOKENS = 24
MIN_MARGIN = 4e-4
PROMPTS = ["The quick brown fox jumps over the lazy dog", "hello there, general", "1 2 3 4 5 6 7 8 9 10 11 12",
           "naïve café, façade and more"]


@dataclass
class Served:
    gateway: str
    http_base: str
    tokenizer: transformers.PreTrainedTokenizerBase
    references: dict[str, Generator]  # by model name: the base, and each adapter merged into it


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Served:
    tmp = tmp_path_factory.mktemp("lora-mesh")
    checkpoint = tmp / "base"
    save_model_directory(checkpoint, "llama", seed=5, std=0.5)
    root = tmp / "model_repo"
    references = {MODEL: _generator(checkpoint)}
    directories = {}
    for name, kwargs in ADAPTERS.items():
        directories[name] = save_lora_adapter(tmp / name, checkpoint, std=0.3, **kwargs)
        references[name] = _generator(save_merged_checkpoint(tmp / f"{name}-merged", checkpoint, directories[name]))
    import_checkpoint(checkpoint, root, ImportOptions(MODEL, "1", kv_cache_bytes=1 << 20,
                                                      lora_adapters=(("ad-x", str(directories["ad-x"])),)))
    http_port = free_port()
    with running_mesh(tmp, env={"HF_HUB_OFFLINE": "1"}) as mesh:
        mesh.start_scheduler("--long-prefill-chunk-tokens", "16")
        wait_all_serving([mesh.start_worker(MODEL, "--model-repository", str(root), "--model-version", "1",
                                            "--lora-adapters", f"ad-y={directories['ad-y']}", wait=False)])
        mesh.start_gateway("--http-port", str(http_port))
        served = Served(mesh.gateway.address, f"https://127.0.0.1:{http_port}/v1",
                        transformers.AutoTokenizer.from_pretrained(checkpoint), references)
        wait_until(lambda: all(_post(served, "/completions", {"model": name, "prompt": "hi", "max_tokens": 1})[0]
                               == 200 for name in references), timeout_s=30, message="base and adapters served")
        yield served


def _generator(directory: Path) -> Generator:
    return Generator(load_llama_family(directory), max_seq_len=256, eos_token_id=2, bos_token_id=1)


def _context() -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(session_tls.session_pki().ca_path))


def _post(served: Served, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(served.http_base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30, context=_context()) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _generate(served: Served, name: str, prompt: str) -> list[int]:
    request = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name=name), prompt=prompt,
                                          sampling=common_pb2.SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True))
    ids: list[int] = []
    with session_tls.channel(served.gateway) as channel:
        for chunk in gateway_pb2_grpc.InferenceStub(channel).Generate(request, timeout=120):
            ids += chunk.token_ids
    return ids


def _reference(gen: Generator, prompt_ids: list[int]) -> tuple[list[int], int]:
    """Greedy tokens of the reference (dense forward), and how many precede its first near tie."""
    ids, trusted = list(prompt_ids), None
    for i in range(NUM_NEW_TOKENS):
        logits = gen.dense_logits(ids)[-1]
        top = torch.topk(logits, 2).values
        if trusted is None and float(top[0] - top[1]) < MIN_MARGIN:
            trusted = i
        ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):], NUM_NEW_TOKENS if trusted is None else trusted


def test_models_lists_each_adapter_with_its_base_as_parent(served):
    request = urllib.request.Request(served.http_base + "/models")
    with urllib.request.urlopen(request, timeout=30, context=_context()) as reply:
        listed = {m["id"]: m for m in json.loads(reply.read())["data"]}
    assert {name: listed[name]["parent"] for name in served.references} == {
        MODEL: None, "ad-x": MODEL, "ad-y": MODEL}
    assert listed["ad-x"]["versions"] == ["1"]


def test_base_and_two_adapters_in_one_batch_equal_each_model_alone(served):
    # The base first, so each prompt's blocks are cached before the adapters ask for the same prompt.
    for prompt in PROMPTS:
        _generate(served, MODEL, prompt)
    jobs = [(name, prompt) for prompt in PROMPTS for name in served.references]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        got = list(pool.map(lambda job: _generate(served, *job), jobs))
    compared = 0
    for (name, prompt), tokens in zip(jobs, got, strict=True):
        expected, trusted = _reference(served.references[name], served.tokenizer(prompt).input_ids)
        assert tokens[:trusted] == expected[:trusted], (name, prompt)
        assert len(tokens) == NUM_NEW_TOKENS
        compared += trusted
    assert compared >= 0.9 * len(jobs) * NUM_NEW_TOKENS, f"only {compared} tokens before near ties"
    # The adapters change the model: else equality with the merged references would prove nothing.
    assert got[0] != got[1] and got[0] != got[2]


def test_an_unknown_adapter_is_a_404_naming_it(served):
    status, body = _post(served, "/completions", {"model": "ad-nope", "prompt": "hi", "max_tokens": 1})
    assert status == 404 and "ad-nope" in body["error"]["message"]
