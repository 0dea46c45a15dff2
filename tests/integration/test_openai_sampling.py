"""The OpenAI API's sampling options on a Hugging Face checkpoint through the whole mesh (issue 39):
logprobs equal log_softmax of transformers' logits (over the temperature) at every position, streamed
or not, in OpenAI's shapes as the stock `openai` client parses them, and on the gRPC API; penalties
and logit_bias apply where the worker samples, and a penalized seeded stream resumed elsewhere (a
continuation, as after a failover) goes on exactly as the unbroken one.
One mesh for the module: a scheduler, a worker of a tiny Llama checkpoint made here, a gateway.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import torch
import transformers

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, scheduler_pb2
from tests.support.hf_checkpoints import save_model_directory
from tests.support.hf_mesh import serving_checkpoints
from tests.support.https_json import post_json, post_stream
from tests.support.side_venv import side_venv_python
from tools.testbed import session_tls
from tools.testbed.gateway_fixtures import scrape
from tools.testbed.scheduler_fixtures import scheduler_stub
from tools.testbed.scheduler_fixtures import tenant as scheduler_tenant

pytestmark = pytest.mark.integration

MODEL = "tiny-sampling"
SIDE_VENV = ("openai", "openai==3.51.0")  # the venv of tests/openai/test_openai_client.py, built once
SCRIPT = Path(__file__).with_name("openai_sampling_script.py")
# float32 on both sides, different kernels: logprobs agree to about 1e-5; a loose bound, never a CPU's digits.
TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai-sampling")
    model = save_model_directory(tmp / MODEL, "llama3", seed=5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp / MODEL)
    with serving_checkpoints(tmp, [MODEL]) as served:
        served.mesh.metrics_port = served.metrics_port
        served.mesh.block_size = served.block_size
        yield served.mesh, served.base, model, tokenizer


def reference_log_probs(model, ids: list[int], num_prompt: int, temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature) at each output position: row i predicts output token i."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, num_prompt - 1 : len(ids) - 1].double()
    return torch.log_softmax(logits / (temperature or 1.0), dim=-1)


def check_against_reference(reference: torch.Tensor, token_ids: list[int], logprobs: list[float],
                            tops: list[list[float]]) -> None:
    assert len(logprobs) == len(token_ids) == reference.shape[0]
    for i, token in enumerate(token_ids):
        assert logprobs[i] == pytest.approx(float(reference[i, token]), abs=TOLERANCE), i
        # By value: a near tie may order two alternatives differently than transformers does.
        expected = reference[i].topk(len(tops[i])).values.tolist()
        assert sorted(tops[i], reverse=True) == pytest.approx(expected, abs=TOLERANCE), i


def generate_over_grpc(served, temperature: float, *, seed: int, top: int, prompt: str = "",
                       messages: list[dict] | None = None):
    """The output ids and every chunk's logprobs, 12 tokens."""
    mesh = served[0]
    request = gateway_pb2.GenerateRequest(
        model=common_pb2.ModelRef(name=MODEL), prompt=prompt,
        messages=[gateway_pb2.ChatMessage(**m) for m in messages or []],
        sampling=common_pb2.SamplingParams(max_tokens=12, temperature=temperature, seed=seed, ignore_eos=True,
                                           logprobs=True, top_logprobs=top))
    ids: list[int] = []
    positions: list[common_pb2.PositionLogprobs] = []
    with session_tls.channel(mesh.gateway.address) as channel:
        for chunk in gateway_pb2_grpc.InferenceStub(channel).Generate(request, timeout=60):
            assert len(chunk.logprobs) == len(chunk.token_ids)
            ids += chunk.token_ids
            positions += chunk.logprobs
    assert [p.token.token_id for p in positions] == ids
    return ids, positions


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_grpc_logprobs_are_log_softmax_of_the_reference_logits(served, temperature):
    _, _, model, tokenizer = served
    prompt_ids = tokenizer("Once upon a time")["input_ids"]
    ids, positions = generate_over_grpc(served, temperature, seed=3, top=4, prompt="Once upon a time")
    reference = reference_log_probs(model, prompt_ids + ids, len(prompt_ids), temperature)
    check_against_reference(reference, ids, [p.token.logprob for p in positions],
                            [[t.logprob for t in p.top] for p in positions])
    # Each token's bytes, as the tokenizer decodes it alone (ids past the tokenizer carry none).
    tokens = {t.token_id: t.token_bytes for p in positions for t in (p.token, *p.top)}
    assert {i: b.decode(errors="replace") for i, b in tokens.items()} == {
        i: tokenizer.decode([i]) if i < len(tokenizer) else "" for i in tokens}


def test_chat_logprobs_are_log_softmax_of_the_reference_logits_of_the_rendered_conversation(served):
    _, _, model, tokenizer = served
    messages = [{"role": "user", "content": "Hello there"}]
    prompt_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False))
    ids, positions = generate_over_grpc(served, 0.7, seed=11, top=2, messages=messages)
    reference = reference_log_probs(model, prompt_ids + ids, len(prompt_ids), 0.7)
    check_against_reference(reference, ids, [p.token.logprob for p in positions],
                            [[t.logprob for t in p.top] for p in positions])


def test_the_stock_client_parses_logprobs_streamed_n_and_json_schema_output(served):
    mesh, base, _, _ = served
    python = side_venv_python(*SIDE_VENV)
    done = subprocess.run([str(python), str(SCRIPT), base, str(session_tls.session_pki().ca_path), MODEL],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr + mesh.logs()
    seen = json.loads(done.stdout)
    completion = seen["completion"]
    _, positions = generate_over_grpc(served, 0.0, seed=0, top=3, prompt="The sky")
    assert completion["token_logprobs"] == pytest.approx([p.token.logprob for p in positions[:6]], abs=1e-6)
    assert seen["stream_completion"] == pytest.approx(completion["token_logprobs"], abs=1e-6)
    assert completion["text_offset"] == [sum(len(t) for t in completion["tokens"][:i]) for i in range(6)]
    # The 3 most likely, and the sampled token (greedy: among them), by text: tokens whose texts are
    # equal (parts of a character, each shown as U+FFFD) share one key, as in OpenAI's and vLLM's shape.
    for token, top, position in zip(completion["tokens"], completion["top_logprobs"], positions, strict=False):
        assert token in top and 1 <= len(top) <= 3
        assert all(any(abs(value - t.logprob) < 1e-6 for t in position.top) for value in top.values())
    chat = seen["chat"]
    assert len(chat["entries"]) == 6 and all(len(e["top"]) == 2 for e in chat["entries"])
    assert bytes(b for e in chat["entries"] for b in e["bytes"]).decode(errors="replace") == chat["text"]
    assert seen["stream_chat"] == pytest.approx([e["logprob"] for e in chat["entries"]], abs=1e-6)
    _, positions = generate_over_grpc(served, 0.7, seed=11, top=2, messages=[{"role": "user",
                                                                               "content": "Hello there"}])
    assert [e["logprob"] for e in chat["entries"]] == pytest.approx([p.token.logprob for p in positions[:6]],
                                                                    abs=1e-6)
    # n streamed: each choice's deltas by index, choice i sampled with seed + i.
    single = [_chat(base, max_tokens=5, temperature=1.0, seed=3 + i, ignore_eos=True,
                    messages=[{"role": "user", "content": "Hello there"}])["choices"][0]["message"]["content"]
              for i in range(3)]
    assert seen["stream_n"] == single
    assert [reason for _, reason in seen["structured"]] == ["stop", "stop"]
    assert all(isinstance(json.loads(content)["ok"], bool) for content, _ in seen["structured"])


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 3}, "top_logprobs"),
])
def test_bad_logprobs_are_400_naming_the_parameter(served, path, body, param):
    status, reply = post_json(served[1], path, {"model": MODEL, **body})
    assert (status, reply["error"]["param"]) == (400, param)


def test_grpc_top_logprobs_over_the_limit_is_invalid_argument(served):
    import grpc

    request = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name=MODEL), prompt="a",
                                          sampling=common_pb2.SamplingParams(logprobs=True, top_logprobs=21))
    with session_tls.channel(served[0].gateway.address) as channel, pytest.raises(grpc.RpcError) as caught:
        list(gateway_pb2_grpc.InferenceStub(channel).Generate(request, timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.top_logprobs must be at most 20" in caught.value.details()


def test_logit_bias_forces_a_token_and_an_unknown_id_is_a_400_naming_it(served):
    _, base, _, tokenizer = served
    forced = tokenizer.convert_tokens_to_ids("e")
    status, reply = post_json(base, "/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5,
                                                "temperature": 1.0, "seed": 2, "ignore_eos": True,
                                                "logit_bias": {str(forced): 100}})
    assert status == 200, reply
    assert reply["choices"][0]["text"] == "e" * 5
    status, reply = post_json(base, "/completions", {"model": MODEL, "prompt": "a", "logit_bias": {"1000000": 1}})
    assert (status, reply["error"]["param"]) == (400, "logit_bias")
    assert "token id 1000000 is not a token of this model" in reply["error"]["message"]


def _schedule(stub, sampling: common_pb2.SamplingParams, delivered: list[int]) -> list[int]:
    request = scheduler_pb2.ScheduleGenerateRequest(
        request=gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name=MODEL, version="1"),
                                            prompt="Once upon a time", sampling=sampling),
        tenant=scheduler_tenant("t"), continuation=scheduler_pb2.GenerateContinuation(token_ids=delivered))
    return [t for reply in stub.Generate(request, timeout=60) for t in reply.chunk.token_ids]


def test_a_penalized_seeded_stream_resumed_as_a_continuation_goes_on_as_the_unbroken_one(served):
    mesh = served[0]
    sampling = common_pb2.SamplingParams(max_tokens=16, temperature=0.9, seed=21, ignore_eos=True,
                                         presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.3,
                                         logit_bias={5: -3.0})
    with scheduler_stub(mesh.scheduler.address) as stub:
        unbroken = _schedule(stub, sampling, [])
        resumed = _schedule(stub, sampling, unbroken[:7])
        plain = common_pb2.SamplingParams(max_tokens=16, temperature=0.9, seed=21, ignore_eos=True)
        unpenalized = _schedule(stub, plain, [])
    assert len(unbroken) == 16 and resumed == unbroken[7:]
    assert unpenalized != unbroken, "the penalties changed what was sampled"


PROMPT_N = "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, filled with the ends of " \
           "worms and an oozy smell, nor yet a dry, bare, sandy hole with nothing in it to sit down on or to eat"


def _complete(base: str, **over) -> dict:
    status, reply = post_json(base, "/completions", {"model": MODEL, "prompt": PROMPT_N, "max_tokens": 8,
                                                "ignore_eos": True, **over})
    assert status == 200, reply
    return reply


def _cache(mesh) -> tuple[float, float]:
    metrics = scrape(mesh.metrics_port)
    return (metrics.value("infermesh_scheduler_prefix_cache_queried_tokens_total", model=MODEL),
            metrics.value("infermesh_scheduler_prefix_cache_hit_tokens_total", model=MODEL))


def test_n_seeded_choices_are_reproducible_share_the_prompt_and_usage_counts_them_all(served):
    mesh, base, _, _ = served
    queried_before, hits_before = _cache(mesh)
    reply = _complete(base, n=4, temperature=1.0, seed=40)
    queried, hits = _cache(mesh)
    texts = [c["text"] for c in reply["choices"]]
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3] and len(set(texts)) > 1
    prompt_tokens = reply["usage"]["prompt_tokens"]
    assert reply["usage"]["completion_tokens"] == 4 * 8
    assert reply["usage"]["total_tokens"] == prompt_tokens + 32
    # The prompt computed once: the other three choices found its full blocks in the prefix cache.
    full_blocks = prompt_tokens // mesh.block_size * mesh.block_size
    assert queried - queried_before == 4 * prompt_tokens
    assert hits - hits_before >= 3 * (full_blocks - mesh.block_size)
    assert [c["text"] for c in _complete(base, n=4, temperature=1.0, seed=40)["choices"]] == texts
    # Choice i samples with seed + i: it is the single request with that seed.
    assert _complete(base, temperature=1.0, seed=42)["choices"][0]["text"] == texts[2]


def test_greedy_choices_are_all_equal_and_stream_with_their_indexes(served):
    _, base, _, _ = served
    reply = _complete(base, n=3, temperature=0)
    assert len({c["text"] for c in reply["choices"]}) == 1
    status, streamed = post_stream(base, "/completions", {
        "model": MODEL, "prompt": PROMPT_N, "max_tokens": 8, "ignore_eos": True, "n": 3, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    *events, usage_event, done = streamed
    texts = ["".join(e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == i) for i in range(3)]
    assert texts == [c["text"] for c in reply["choices"]] and done == "[DONE]"
    assert sum(e["choices"][0]["finish_reason"] is not None for e in events) == 3
    assert usage_event["usage"]["completion_tokens"] == 24


def test_best_of_returns_the_choices_with_the_best_mean_logprob_and_bills_them_all(served):
    _, base, _, _ = served
    candidates = _complete(base, n=3, temperature=1.0, seed=7, logprobs=0)["choices"]
    means = [sum(c["logprobs"]["token_logprobs"]) / 8 for c in candidates]
    reply = _complete(base, n=1, best_of=3, temperature=1.0, seed=7)
    assert reply["choices"][0]["text"] == candidates[means.index(max(means))]["text"]
    assert reply["choices"][0]["logprobs"] is None, "not asked for: used to rank, not returned"
    assert reply["usage"]["completion_tokens"] == 24


NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{2,5}$"},
        "kind": {"enum": ["cat", "dog", "owl"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                 "minItems": 1, "maxItems": 3},
        "owner": {"type": "object", "properties": {"adult": {"type": "boolean"}}, "required": ["adult"],
                  "additionalProperties": False},
    },
    "required": ["name", "kind", "tags", "owner"],
    "additionalProperties": False,
}


def test_every_seeded_sample_of_a_json_schema_validates(served):
    _, base, _, _ = served
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": NESTED_SCHEMA,
                                                                       "strict": True}}}
    outputs = []
    for seed in range(0, 200, 10):  # 20 x 10 choices: 200 samples, each with its own seed
        reply = _chat(base, n=10, temperature=1.0, seed=seed, max_tokens=120, **body)
        outputs += [(c["message"]["content"], c["finish_reason"]) for c in reply["choices"]]
    for content, reason in outputs:
        assert reason == "stop", content  # the grammar completed: only the end was allowed
        jsonschema.validate(json.loads(content), NESTED_SCHEMA)
    assert len(outputs) == 200 and len({content for content, _ in outputs}) > 1


def _chat(base: str, **over) -> dict:
    status, reply = post_json(base, "/chat/completions", {"model": MODEL, "messages": [{"role": "user",
                                                                                   "content": "A pet, please"}],
                                                     **over})
    assert status == 200, reply
    return reply


@pytest.mark.parametrize(("guided", "pattern"), [
    ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, "[0-9]{3}-[a-z]{2}"),
    ({"guided_choice": ["red", "green", "blue"]}, "red|green|blue"),
    # Any object: a random model's keys run on, so only the ones that ended are whole objects.
    ({"response_format": {"type": "json_object"}}, r"\{.*"),
])
def test_guided_outputs_match_streamed_and_not(served, guided, pattern):
    _, base, _, _ = served
    reply = _complete(base, n=4, temperature=1.0, seed=5, max_tokens=60, ignore_eos=False, **guided)
    texts = [c["text"] for c in reply["choices"]]
    assert all(re.fullmatch(pattern, t, re.DOTALL) for t in texts), texts
    if "json_object" in str(guided):
        assert all(isinstance(json.loads(c["text"]), dict) for c in reply["choices"] if c["finish_reason"] == "stop")
    status, events = post_stream(base, "/completions", {"model": MODEL, "prompt": PROMPT_N, "max_tokens": 60,
                                                        "temperature": 1.0, "seed": 5, "stream": True, **guided})
    assert status == 200
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == texts[0]


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "sampling.structured: invalid json_schema"),
    ({"guided_regex": "[a-"}, "guided_regex", "sampling.structured: invalid regex"),
    ({"guided_choice": []}, "guided_choice", "guided_choice must be a list of 1 to 256 non-empty strings"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "set one of response_format"),
])
def test_a_bad_structured_output_is_a_400_naming_its_parameter(served, body, param, fragment):
    status, reply = post_json(served[1], "/completions", {"model": MODEL, "prompt": "a", **body})
    assert (status, reply["error"]["param"]) == (400, param), reply
    assert fragment in reply["error"]["message"]


def test_grpc_n_streams_every_choice_by_index_each_the_single_request_with_seed_plus_index(served):
    mesh = served[0]

    def generate(n: int, seed: int) -> list[gateway_pb2.GenerateResponse]:
        request = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name=MODEL), prompt=PROMPT_N, n=n,
                                              sampling=common_pb2.SamplingParams(max_tokens=6, temperature=1.0,
                                                                                 seed=seed, ignore_eos=True))
        with session_tls.channel(mesh.gateway.address) as channel:
            return list(gateway_pb2_grpc.InferenceStub(channel).Generate(request, timeout=60))

    chunks = generate(3, 50)
    ids = [[t for c in chunks if c.choice_index == i for t in c.token_ids] for i in range(3)]
    assert ids == [[t for c in generate(1, 50 + i) for t in c.token_ids] for i in range(3)]
    lasts = [c for c in chunks if c.finish_reason]
    assert sorted(c.choice_index for c in lasts) == [0, 1, 2] and all(c.usage.completion_tokens == 6 for c in lasts)
    assert {c.request_id.rsplit("-", 1)[1] for c in chunks} == {"0", "1", "2"}


def test_grpc_n_over_the_limit_is_invalid_argument(served):
    import grpc

    request = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name=MODEL), prompt="a", n=17)
    with session_tls.channel(served[0].gateway.address) as channel, pytest.raises(grpc.RpcError) as caught:
        list(gateway_pb2_grpc.InferenceStub(channel).Generate(request, timeout=30))
    assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "n must be in 0..16, got 17")


def test_grpc_callers_get_structured_output_too(served):
    mesh = served[0]
    request = gateway_pb2.GenerateRequest(
        model=common_pb2.ModelRef(name=MODEL), prompt=PROMPT_N,
        sampling=common_pb2.SamplingParams(max_tokens=40, temperature=1.0, seed=3,
                                           structured=common_pb2.StructuredOutput(regex="[a-f]{4}-[0-9]{1,3}")))
    with session_tls.channel(mesh.gateway.address) as channel:
        chunks = list(gateway_pb2_grpc.InferenceStub(channel).Generate(request, timeout=60))
    assert re.fullmatch("[a-f]{4}-[0-9]{1,3}", "".join(c.text for c in chunks))
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_EOS
