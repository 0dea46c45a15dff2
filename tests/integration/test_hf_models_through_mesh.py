"""Hugging Face checkpoints served by the whole mesh (gateway -> scheduler -> workers, real processes):
greedy tokens equal transformers' generate(do_sample=False) for 16 prompts x 64 tokens per family.

One mesh for the module: a tiny random-weight checkpoint per family (llama with llama3 rope scaling,
qwen2, mistral, qwen3; stored in float32, float16, bfloat16 and bfloat16, served in float32, against
transformers' float32 model of the same rounded weights), each made with transformers' save_pretrained
and imported as
`infermesh models import` does, each served by its own worker. The scheduler prefills in chunks
and caches prefixes; the llama worker has few KV blocks, so its 16 concurrent sequences preempt
one another. The scheduler tokenizes with each model's own tokenizer.json (sent by its worker).

Greedy decoding compares argmaxes: a near tie in transformers' logits (top two within 4e-4,
twice the stated float32 tolerance) may flip on float noise, so each prompt is compared up to its
first near tie, and the test requires that almost all of the 16 x 64 tokens were compared.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest
import torch
import transformers

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.worker.repository.hf_import import ImportOptions, import_checkpoint
from tests.support.hf_checkpoints import END_OF_TEXT_ID, EOT_ID, save_model_directory
from tools.testbed import session_tls
from tools.testbed.gateway_fixtures import scrape
from tools.testbed.processes import free_port, running_mesh, wait_all_serving, wait_until

pytestmark = pytest.mark.integration

# tiny-mistral slides every layer over 12 tokens (Mistral 7B v0.1's window, in small): the prompts and
# outputs run past it, through chunked prefill, the prefix cache and preemption.
FAMILIES = {"tiny-llama": "llama3", "tiny-qwen2": "qwen2", "tiny-mistral": "mistral_window", "tiny-qwen3": "qwen3"}
# Each family's checkpoint in another storage dtype: the worker reads float16 and bfloat16 files into
# its float32 compute (the default --compute-dtype), as transformers' float32 model holds the same
# rounded weights.
STORAGE_DTYPES = {"tiny-llama": torch.float32, "tiny-qwen2": torch.float16, "tiny-mistral": torch.bfloat16,
                  "tiny-qwen3": torch.bfloat16}
NUM_NEW_TOKENS = 64
# tiny-qwen3's generation_config.json recommends greedy decoding (with Qwen3's top_p and top_k beside it,
# which greedy decoding reads past), so an OpenAI request that leaves the temperature out is greedy.
RECOMMENDED_SAMPLING = {"tiny-qwen3": {"do_sample": True, "temperature": 0.0, "top_p": 0.95, "top_k": 20}}
MIN_MARGIN = 4e-4
# Random weights drawn this wide give logits far enough apart that near ties are rare (at 0.25,
# a quarter of the tokens came after one).
WEIGHT_STD = 0.5
LLAMA_KV_BLOCKS = 24  # 16 sequences of ~90 tokens need ~96 blocks of 16: they preempt one another
SYSTEM = "You are a helpful assistant. Answer briefly. "  # a shared prefix the cache holds
PROMPTS = [SYSTEM + p for p in (
    "The quick brown fox", "Grüße aus Köln", "東京は日本の首都です", "Emoji: 🙂🚀", "naïve café, façade",
    "Съешь же ещё этих мягких", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "jalapeño!", "the lazy dog",
    "hello there", "and the dog sleeps on.", "今日はいい天気ですね", "French 🇫🇷 bulk", "1 2 3 4 5 6 7 8 9",
)]


@dataclass
class Served:
    gateway: str
    http_base: str
    scheduler_metrics_port: int
    references: dict[str, transformers.PreTrainedModel]
    tokenizers: dict[str, transformers.PreTrainedTokenizerBase]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Served:
    tmp = tmp_path_factory.mktemp("hf-mesh")
    root = tmp / "model_repo"
    references, tokenizers = {}, {}
    for seed, (name, family) in enumerate(FAMILIES.items()):
        checkpoint = tmp / family
        references[name] = save_model_directory(checkpoint, family, seed=seed, std=WEIGHT_STD,
                                                dtype=STORAGE_DTYPES[name])
        tokenizers[name] = transformers.AutoTokenizer.from_pretrained(checkpoint)
        if name in RECOMMENDED_SAMPLING:  # what a model card's generation_config.json recommends
            path = checkpoint / "generation_config.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), **RECOMMENDED_SAMPLING[name]}))
        import_checkpoint(checkpoint, root, ImportOptions(name, "1", kv_cache_bytes=1 << 20))
    metrics_port, http_port = free_port(), free_port()
    with running_mesh(tmp, env={"HF_HUB_OFFLINE": "1"}) as mesh:
        mesh.start_scheduler("--metrics-port", str(metrics_port), "--long-prefill-chunk-tokens", "16")
        workers = []
        for name in FAMILIES:
            extra = ("--num-kv-blocks", str(LLAMA_KV_BLOCKS)) if name == "tiny-llama" else ()
            workers.append(mesh.start_worker(name, "--model-repository", str(root), "--model-version", "1", *extra,
                                             wait=False))
        wait_all_serving(workers)
        mesh.start_gateway("--http-port", str(http_port))
        served = Served(mesh.gateway.address, f"https://127.0.0.1:{http_port}/v1", metrics_port, references,
                        tokenizers)
        wait_until(lambda: all(_listed(served, name) for name in FAMILIES), timeout_s=30, message="models listed")
        yield served


def _listed(served: Served, name: str) -> bool:
    status, body = _post(served, "/completions", {"model": name, "prompt": "hi", "max_tokens": 1})
    return status == 200


def _post(served: Served, path: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(served.http_base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    context = ssl.create_default_context(cafile=str(session_tls.session_pki().ca_path))
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@dataclass(frozen=True)
class Stream:
    token_ids: list[int]
    text: str
    finish_reason: int
    usage: common_pb2.Usage


def generate(served: Served, name: str, prompt: str, **sampling) -> Stream:
    request = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name=name, version="1"), prompt=prompt,
                                          sampling=common_pb2.SamplingParams(**sampling))
    ids, text, last = [], [], None
    with session_tls.channel(served.gateway) as channel:
        for chunk in gateway_pb2_grpc.InferenceStub(channel).Generate(request, timeout=120):
            assert chunk.index == len(ids) or not chunk.token_ids
            ids += chunk.token_ids
            text.append(chunk.text)
            last = chunk
    return Stream(ids, "".join(text), last.finish_reason, last.usage)


def reference_greedy(model, prompt_ids: list[int]) -> tuple[list[int], int]:
    """transformers' greedy tokens with EOS ignored, and how many of them precede the first near tie."""
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=NUM_NEW_TOKENS, eos_token_id=None,
                                           pad_token_id=END_OF_TEXT_ID, output_scores=True,
                                           return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), generation_config=config)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    trusted = len(tokens)
    for i, scores in enumerate(out.scores):
        top = torch.topk(scores[0].float(), 2).values
        if float(top[0] - top[1]) < MIN_MARGIN:
            trusted = i
            break
    return tokens, trusted


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_greedy_tokens_through_the_mesh_equal_transformers_generate(served, name):
    tokenizer, model = served.tokenizers[name], served.references[name]
    generate(served, name, PROMPTS[0], max_tokens=4)  # its prefix blocks are cached for the 16 below
    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        streams = list(pool.map(
            lambda p: generate(served, name, p, max_tokens=NUM_NEW_TOKENS, ignore_eos=True), PROMPTS))
    compared = 0
    for prompt, stream in zip(PROMPTS, streams, strict=True):
        prompt_ids = tokenizer(prompt).input_ids
        expected, trusted = reference_greedy(model, prompt_ids)
        assert stream.token_ids[:trusted] == expected[:trusted], prompt
        assert len(stream.token_ids) == NUM_NEW_TOKENS
        assert stream.finish_reason == common_pb2.FINISH_REASON_LENGTH
        # usage counts the model's tokens: the prompt as its tokenizer encodes it, every token generated
        assert (stream.usage.prompt_tokens, stream.usage.completion_tokens) == (len(prompt_ids), NUM_NEW_TOKENS)
        assert stream.text == tokenizer.decode(stream.token_ids, skip_special_tokens=True)
        compared += trusted
    assert compared >= 0.9 * len(PROMPTS) * NUM_NEW_TOKENS, f"only {compared} tokens before near ties"
    if name != "tiny-llama":  # the llama worker's few blocks are evicted and preempted
        assert all(s.usage.cached_prompt_tokens >= 16 for s in streams)


def test_the_llama_worker_preempted_and_still_matched(served):
    metrics = scrape(served.scheduler_metrics_port)
    assert metrics.value("infermesh_scheduler_preemptions_total", model="tiny-llama") > 0


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_any_of_generation_configs_eos_ids_ends_the_stream_where_transformers_stops(served, name):
    """Without ignore_eos a stream ends on <|end_of_text|> or <|eot_id|>, as generate does with
    generation_config.json's list; searched over prompts until one ends early (the step scheduler's
    unit tests end on each id of the list)."""
    tokenizer, model = served.tokenizers[name], served.references[name]
    for i in range(64):
        prompt = f"{i} {PROMPTS[i % len(PROMPTS)][len(SYSTEM):]}"
        prompt_ids = tokenizer(prompt).input_ids
        expected, trusted = reference_greedy(model, prompt_ids)
        stop = next((k for k, t in enumerate(expected[:trusted]) if t in (END_OF_TEXT_ID, EOT_ID)), None)
        if stop is None:
            continue
        stream = generate(served, name, prompt, max_tokens=NUM_NEW_TOKENS)
        assert stream.token_ids == expected[:stop]
        assert stream.finish_reason == common_pb2.FINISH_REASON_EOS
        assert stream.usage.completion_tokens == stop + 1  # the end token is counted, never streamed
        return
    pytest.fail(f"none of 64 prompts ends within {NUM_NEW_TOKENS} tokens for {name}")


def test_a_prompt_longer_than_the_context_is_invalid_argument_with_both_lengths(served):
    prompt = "The quick brown fox " * 200
    num_ids = len(served.tokenizers["tiny-qwen2"](prompt).input_ids)
    with pytest.raises(grpc.RpcError) as caught:
        generate(served, "tiny-qwen2", prompt, max_tokens=8)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{num_ids} tokens" in caught.value.details() and "256" in caught.value.details()
    status, body = _post(served, "/completions", {"model": "tiny-qwen2", "prompt": prompt, "max_tokens": 8})
    assert status == 400
    assert f"{num_ids} tokens" in body.decode() and "256" in body.decode()


def _completion_ids(served: Served, name: str, **body) -> list[int]:
    status, raw = _post(served, "/completions", {"model": name, "prompt": PROMPTS[5], "max_tokens": 16,
                                                 "ignore_eos": True, "return_token_ids": True, **body})
    assert status == 200, raw
    return json.loads(raw)["choices"][0]["token_ids"]


def test_openai_requests_that_leave_sampling_out_get_the_models_recommended_sampling(served):
    """As vLLM applies generation_config.json: tiny-qwen3 recommends temperature 0, so a completion
    without one is greedy, and one that sets its own samples; tiny-qwen2 recommends nothing, so a
    completion without one samples at OpenAI's temperature 1, as gRPC does when asked for it."""
    greedy = generate(served, "tiny-qwen3", PROMPTS[5], max_tokens=16, ignore_eos=True).token_ids
    assert _completion_ids(served, "tiny-qwen3", seed=3) == greedy
    assert _completion_ids(served, "tiny-qwen3", seed=3, temperature=1.0) != greedy
    at_one = generate(served, "tiny-qwen2", PROMPTS[5], max_tokens=16, ignore_eos=True, temperature=1.0, seed=3)
    assert _completion_ids(served, "tiny-qwen2", seed=3) == at_one.token_ids


def test_seeded_sampling_gives_the_same_tokens_each_time(served):
    first = generate(served, "tiny-mistral", PROMPTS[3], max_tokens=32, temperature=0.8, seed=7, ignore_eos=True)
    again = generate(served, "tiny-mistral", PROMPTS[3], max_tokens=32, temperature=0.8, seed=7, ignore_eos=True)
    other = generate(served, "tiny-mistral", PROMPTS[3], max_tokens=32, temperature=0.8, seed=8, ignore_eos=True)
    assert first.token_ids == again.token_ids and len(first.token_ids) == 32
    assert other.token_ids != first.token_ids


if os.environ.get("HF_HUB_OFFLINE") != "1":  # tests.support.hf_checkpoints sets it before transformers loads
    raise RuntimeError("HF_HUB_OFFLINE must be 1: nothing may be downloaded")
