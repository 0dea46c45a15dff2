"""Prompt logprobs and echo on a Hugging Face checkpoint through the whole mesh (issue 39): each
prompt token's logprob is log_softmax of transformers' logits at the position before it (raw, no
temperature), over a chunked prefill (a 16-token step budget), with and without a warm prefix cache;
the stock `openai` client reads echo + logprobs (max_tokens 0 scores the prompt alone), streamed and
not; the gRPC API carries them on the first chunk only, and a continuation (a resumed stream) sends
none again. One mesh for the module: a scheduler, a worker of a tiny Llama checkpoint made here, a gateway.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import grpc
import pytest
import torch
import transformers

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, scheduler_pb2
from tests.support.hf_checkpoints import save_model_directory
from tests.support.hf_mesh import serving_checkpoints
from tests.support.https_json import post_json
from tests.support.side_venv import side_venv_python
from tools.testbed import session_tls
from tools.testbed.scheduler_fixtures import scheduler_stub
from tools.testbed.scheduler_fixtures import tenant as scheduler_tenant

pytestmark = pytest.mark.integration

MODEL = "tiny-prompt-logprobs"
SIDE_VENV = ("openai", "openai==3.51.0")  # the venv of tests/openai/test_openai_client.py, built once
SCRIPT = Path(__file__).with_name("openai_prompt_logprobs_script.py")
PROMPT = ("Once upon a time there was a little model that counted every token of its prompt, "
          "one chunk at a time, and wrote each one down")
# float32 on both sides (paged chunks here, one dense forward in transformers): they agree to about
# 1e-5 on this machine; 1e-3 is a bound no CPU's kernels should break, and far below any real gap.
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai-prompt-logprobs")
    model = save_model_directory(tmp / MODEL, "llama3", seed=7)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp / MODEL)
    with serving_checkpoints(tmp, [MODEL], options={MODEL: {"max_num_batched_tokens": 16}}) as served:
        yield served.mesh, served.base, model, tokenizer


@pytest.fixture(scope="module")
def reference(served) -> tuple[list[int], torch.Tensor]:
    """The prompt's ids and log_softmax of transformers' logits: row j - 1 predicts prompt token j."""
    _, _, model, tokenizer = served
    ids = tokenizer(PROMPT)["input_ids"]
    assert len(ids) > 32, "the prompt must span several 16-token chunks"
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return ids, torch.log_softmax(logits, dim=-1)


def check_prompt_logprobs(reference, token_ids: list[int], logprobs: list[float | None],
                          tops: list[list[float]] | None = None) -> None:
    ids, log_probs = reference
    assert token_ids == ids
    assert logprobs[0] is None or math.isnan(logprobs[0])
    for j in range(1, len(ids)):
        assert logprobs[j] == pytest.approx(float(log_probs[j - 1, ids[j]]), abs=TOLERANCE), j
        if tops is not None:
            # By value: a near tie may order two alternatives differently than transformers does.
            expected = log_probs[j - 1].topk(len(tops[j])).values.tolist()
            assert sorted(tops[j], reverse=True) == pytest.approx(expected, abs=TOLERANCE), j


def generate(served, sampling: common_pb2.SamplingParams) -> list[gateway_pb2.GenerateResponse]:
    request = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name=MODEL), prompt=PROMPT, sampling=sampling)
    with session_tls.channel(served[0].gateway.address) as channel:
        return list(gateway_pb2_grpc.InferenceStub(channel).Generate(request, timeout=60))


def test_grpc_prompt_logprobs_over_a_chunked_prefill_are_the_reference_log_softmax(served, reference):
    chunks = generate(served, common_pb2.SamplingParams(max_tokens=3, temperature=0.7, seed=1, ignore_eos=True,
                                                        prompt_logprobs=3))
    positions = chunks[0].prompt_logprobs
    assert all(not c.prompt_logprobs for c in chunks[1:])
    assert len(positions[0].top) == 0
    assert all(len(p.top) == 3 for p in positions[1:])
    check_prompt_logprobs(reference, [p.token.token_id for p in positions], [p.token.logprob for p in positions],
                          [[t.logprob for t in p.top] for p in positions])


def test_a_request_for_them_reads_nothing_from_a_warm_prefix_cache(served, reference):
    plain = generate(served, common_pb2.SamplingParams(max_tokens=1))
    again = generate(served, common_pb2.SamplingParams(max_tokens=1))
    assert again[-1].usage.cached_prompt_tokens > 0, "the cache holds the prompt's blocks"
    chunks = generate(served, common_pb2.SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert chunks[-1].usage.cached_prompt_tokens == 0 and plain
    positions = chunks[0].prompt_logprobs
    check_prompt_logprobs(reference, [p.token.token_id for p in positions], [p.token.logprob for p in positions])


def test_a_continuation_sends_no_prompt_logprobs_again(served):
    mesh = served[0]
    sampling = common_pb2.SamplingParams(max_tokens=6, seed=2, ignore_eos=True, prompt_logprobs=1)

    def schedule(delivered: list[int]) -> list[gateway_pb2.GenerateResponse]:
        request = scheduler_pb2.ScheduleGenerateRequest(
            request=gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name=MODEL, version="1"), prompt=PROMPT,
                                                sampling=sampling),
            tenant=scheduler_tenant("t"), continuation=scheduler_pb2.GenerateContinuation(token_ids=delivered))
        with scheduler_stub(mesh.scheduler.address) as stub:
            return [reply.chunk for reply in stub.Generate(request, timeout=60)]

    unbroken = schedule([])
    assert unbroken[0].prompt_logprobs
    tokens = [t for c in unbroken for t in c.token_ids]
    resumed = schedule(tokens[:2])
    assert all(not c.prompt_logprobs for c in resumed)
    assert [t for c in resumed for t in c.token_ids] == tokens[2:]


def test_the_stock_client_reads_echo_with_logprobs_streamed_and_not(served, reference):
    mesh, base, _, tokenizer = served
    python = side_venv_python(*SIDE_VENV)
    done = subprocess.run([str(python), str(SCRIPT), base, str(session_tls.session_pki().ca_path), MODEL, PROMPT],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr + mesh.logs()
    seen = json.loads(done.stdout)
    ids = reference[0]
    scored = seen["scored"]
    assert (scored["text"], scored["finish_reason"]) == (PROMPT, "length")
    # Each token's text as the stream shows it: special tokens (the BOS) carry none.
    assert scored["tokens"] == [tokenizer.decode([i], skip_special_tokens=True) for i in ids]
    assert scored["top_logprobs"][0] is None and all(1 <= len(t) <= 3 for t in scored["top_logprobs"][1:])
    check_prompt_logprobs(reference, ids, scored["token_logprobs"])
    assert seen["scored_usage"]["prompt_tokens"] == len(ids)
    assert seen["scored_usage"]["completion_tokens"] == 0
    echoed = seen["echoed"]
    assert echoed["text"].startswith(PROMPT) and len(echoed["tokens"]) == len(ids) + 4
    assert echoed["token_logprobs"][0] is None
    assert echoed["token_logprobs"][1 : len(ids)] == pytest.approx(scored["token_logprobs"][1:], abs=1e-6)
    check_prompt_logprobs(reference, ids, echoed["token_logprobs"][: len(ids)])
    assert echoed["text_offset"] == [sum(len(t) for t in echoed["tokens"][:i]) for i in range(len(echoed["tokens"]))]
    assert seen["echoed_usage"]["completion_tokens"] == 4
    # vLLM's prompt_logprobs beside it: None, then the prompt token and the 2 most likely by id.
    vllm = seen["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(ids)
    for j in range(1, len(ids)):
        assert vllm[j][str(ids[j])]["logprob"] == pytest.approx(echoed["token_logprobs"][j], abs=1e-6)
        assert [e["rank"] for e in vllm[j].values() if e["rank"] is not None] == [1, 2]
    streamed = seen["streamed"]
    assert streamed["text"] == echoed["text"] and streamed["tokens"] == echoed["tokens"]
    assert streamed["token_logprobs"][0] is None
    assert streamed["token_logprobs"][1:] == pytest.approx(echoed["token_logprobs"][1:], abs=1e-6)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/completions", {"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/completions", {"prompt": "a", "echo": True, "logprobs": 21}, "logprobs"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "a"}], "echo": True}, "echo"),
])
def test_bad_prompt_options_are_400_naming_the_field(served, path, body, param):
    status, reply = post_json(served[1], path, {"model": MODEL, **body})
    assert (status, reply["error"]["param"]) == (400, param)


def test_grpc_prompt_logprobs_over_the_cap_is_invalid_argument(served):
    with pytest.raises(grpc.RpcError) as caught:
        generate(served, common_pb2.SamplingParams(prompt_logprobs=21))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.prompt_logprobs must be at most 20" in caught.value.details()
