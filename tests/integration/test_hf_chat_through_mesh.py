"""Chat on a Hugging Face checkpoint through the whole mesh (gateway -> scheduler -> worker, real
processes): the scheduler renders the model's own chat template, so the conversation's ids and the
greedy reply equal transformers' apply_chat_template(add_generation_prompt=True) + generate. The
same checkpoint without a template answers chat with a 400 that says so, and completions still work.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.worker.repository.hf_import import ImportOptions, import_checkpoint
from tests.support.hf_checkpoints import END_OF_TEXT_ID, save_model_directory
from tests.support.https_json import post_json
from tools.testbed import session_tls
from tools.testbed.processes import free_port, running_mesh, wait_all_serving, wait_until

pytestmark = pytest.mark.integration

CHAT, PLAIN = "tiny-chat", "tiny-no-template"
NUM_NEW_TOKENS = 32
MIN_MARGIN = 4e-4  # as test_hf_models_through_mesh: a near tie may flip on float noise
CONVERSATIONS = [
    [{"role": "user", "content": "Grüße aus Köln 🙂"}],
    [{"role": "system", "content": " Answer briefly. "}, {"role": "user", "content": "東京は日本の首都です"},
     {"role": "assistant", "content": "はい"}, {"role": "user", "content": "naïve café?"}],
]


def _drop_template(directory: Path) -> None:
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf-chat")
    root = tmp / "model_repo"
    model = save_model_directory(tmp / CHAT, "llama3", seed=3)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp / CHAT)
    save_model_directory(tmp / PLAIN, "llama3", seed=3)
    _drop_template(tmp / PLAIN)
    for name in (CHAT, PLAIN):
        import_checkpoint(tmp / name, root, ImportOptions(name, "1", kv_cache_bytes=1 << 20))
    http_port = free_port()
    with running_mesh(tmp, env={"HF_HUB_OFFLINE": "1"}) as mesh:
        mesh.start_scheduler()
        wait_all_serving([mesh.start_worker(name, "--model-repository", str(root), "--model-version", "1", wait=False)
                          for name in (CHAT, PLAIN)])
        mesh.start_gateway("--http-port", str(http_port))
        base = f"https://127.0.0.1:{http_port}/v1"
        wait_until(lambda: all(post_json(base, "/completions", {"model": n, "prompt": "hi", "max_tokens": 1})[0] == 200
                               for n in (CHAT, PLAIN)), timeout_s=30, message="models listed")
        yield mesh.gateway.address, base, model, tokenizer




def _chat_over_grpc(address: str, messages) -> tuple[list[int], str, common_pb2.Usage]:
    request = gateway_pb2.GenerateRequest(
        model=common_pb2.ModelRef(name=CHAT), messages=[gateway_pb2.ChatMessage(**m) for m in messages],
        sampling=common_pb2.SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True))
    ids, text, last = [], [], None
    with session_tls.channel(address) as channel:
        for chunk in gateway_pb2_grpc.InferenceStub(channel).Generate(request, timeout=120):
            ids += chunk.token_ids
            text.append(chunk.text)
            last = chunk
    assert last is not None
    return ids, "".join(text), last.usage


def _reference(model, prompt_ids: list[int]) -> tuple[list[int], int]:
    """transformers' greedy tokens (EOS ignored) and how many precede the first near tie."""
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=NUM_NEW_TOKENS, eos_token_id=None,
                                           pad_token_id=END_OF_TEXT_ID, output_scores=True,
                                           return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), generation_config=config)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    for i, scores in enumerate(out.scores):
        top = torch.topk(scores[0].float(), 2).values
        if float(top[0] - top[1]) < MIN_MARGIN:
            return tokens, i
    return tokens, len(tokens)


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_chat_equals_transformers_apply_chat_template_and_generate(served, conversation):
    address, base, model, tokenizer = served
    messages = CONVERSATIONS[conversation]
    prompt_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False))
    expected, trusted = _reference(model, prompt_ids)
    ids, text, usage = _chat_over_grpc(address, messages)
    print(f"conversation {conversation}: {trusted} of {NUM_NEW_TOKENS} tokens compared")
    assert trusted >= NUM_NEW_TOKENS // 2, f"a near tie after {trusted} tokens leaves too little to compare"
    assert ids[:trusted] == expected[:trusted]
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), NUM_NEW_TOKENS)
    status, reply = post_json(base, "/chat/completions", {"model": CHAT, "messages": messages, "temperature": 0,
                                                      "max_tokens": NUM_NEW_TOKENS, "ignore_eos": True})
    assert status == 200, reply
    assert reply["choices"][0]["message"]["content"] == text
    assert reply["usage"]["prompt_tokens"] == len(prompt_ids)


def test_a_checkpoint_without_a_template_answers_chat_400_and_completions_200(served):
    _, base, _, _ = served
    status, reply = post_json(base, "/chat/completions", {"model": PLAIN, "messages": CONVERSATIONS[0]})
    assert (status, reply["error"]["type"], reply["error"]["message"]) == (
        400, "invalid_request_error",
        "this model has no chat template, so it cannot answer chat; send a prompt (completions) instead of messages")
    assert post_json(base, "/completions", {"model": PLAIN, "prompt": "hi", "max_tokens": 2})[0] == 200
