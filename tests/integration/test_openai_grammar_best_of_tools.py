"""What issue 39 added last, through the whole mesh on a tiny Qwen2 checkpoint made here (its chat
template offers tools in the Hermes format): best_of on /v1/completions and on the gRPC Generate,
vLLM's guided_grammar (GBNF/EBNF or Lark, through llguidance) on both fronts and KServe, and
parallel_tool_calls false. The stock `openai` client sends what it can (extra_body for vLLM's
extras). Nothing here compares against a CPU's float results: best_of's ranking is checked against
the same mesh's own logprobs of the same seeded candidates, grammars by the shape of the outputs.
One mesh for the module: a scheduler, a worker, a gateway.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import grpc
import pytest

from inference import grpc_predict_v2_pb2 as kserve
from inference import grpc_predict_v2_pb2_grpc as kserve_grpc
from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.kserve.codec import unpack_bytes_tensor
from tests.support.hf_mesh import run_stock_client, serving_hermes_qwen2
from tests.support.https_json import post_json
from tools.testbed import session_tls
from tools.testbed.gateway_fixtures import scrape

pytestmark = pytest.mark.integration

MODEL = "tiny-grammar"
SIDE_VENV = ("openai", "openai==3.51.0")  # the venv of tests/openai/test_openai_client.py, built once
SCRIPT = Path(__file__).with_name("openai_grammar_best_of_script.py")
PROMPT = "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, filled with the ends of " \
         "worms and an oozy smell"
# The same language twice: GBNF/EBNF (xgrammar's and llama.cpp's form) and Lark (llguidance's).
GBNF = 'root ::= answer " " number\nanswer ::= "yes" | "no" | "maybe"\nnumber ::= [1-9] [0-9]?'
LARK = 'start: ANSWER " " NUMBER\nANSWER: "yes" | "no" | "maybe"\nNUMBER: /[1-9][0-9]?/'
LANGUAGE = "(yes|no|maybe) [1-9][0-9]?"
# No arguments, and none other allowed: a constrained random model closes the object at once.
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {},
                                                                       "additionalProperties": False}}}
         for name in ("clock", "weather")]
# Auto through the mesh: a grammar holds the random model to two Hermes calls, so the parser has them to read.
TWO_CALLS = 'root ::= call "\\n" call\ncall ::= "<tool_call>{\\"name\\": \\"" name "\\", \\"arguments\\": {}}' \
            '</tool_call>"\nname ::= "clock" | "weather"'


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with serving_hermes_qwen2(tmp_path_factory.mktemp("openai-grammar"), MODEL) as served:
        yield served


@pytest.fixture(scope="module")
def client_seen(served):
    cases = {"prompt": PROMPT, "tools": TOOLS, "grammar": GBNF, "bad_grammar": "start: answer", "two_calls": TWO_CALLS}
    return run_stock_client(served, SIDE_VENV, SCRIPT, MODEL, cases)


def _mean(logprobs: list[float]) -> float:
    return sum(logprobs) / len(logprobs)


# -- best_of -----------------------------------------------------------------------------


def test_the_stock_clients_best_of_returns_the_best_seeded_candidates_and_bills_them_all(client_seen):
    candidates = client_seen["candidates"]  # the same request's three seeded candidates, with their logprobs
    ranked = sorted(range(3), key=lambda i: (-_mean(candidates[i]["token_logprobs"]), i))
    best = client_seen["best_of"]
    assert best["texts"] == [candidates[i]["text"] for i in ranked[:2]] and best["indexes"] == [0, 1]
    assert best["logprobs"] == [None, None], "used to rank, not asked for: not returned"
    assert best["usage"]["completion_tokens"] == 3 * 6
    assert client_seen["best_of_stream"] == {
        "status": 400, "param": "best_of",
        "message": "best_of > n cannot be streamed: the best choices are known at the end"}


def _generate(served, **fields) -> list[gateway_pb2.GenerateResponse]:
    sampling = fields.pop("sampling", {})
    fields = {"prompt": PROMPT, **fields} if "messages" not in fields else fields
    request = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name=MODEL), **fields,
                                          sampling=common_pb2.SamplingParams(**sampling))
    with session_tls.channel(served.mesh.gateway.address) as channel:
        return list(gateway_pb2_grpc.InferenceStub(channel).Generate(request, timeout=60))


def _cache_hits(served) -> float:
    return scrape(served.metrics_port).value("infermesh_scheduler_prefix_cache_hit_tokens_total", model=MODEL)


def _ids(chunks: list[gateway_pb2.GenerateResponse], index: int) -> list[int]:
    return [t for c in chunks if c.choice_index == index for t in c.token_ids]


def test_grpc_best_of_streams_the_n_best_candidates_whole_sharing_the_prompt(served):
    sampling = {"max_tokens": 6, "temperature": 1.0, "seed": 31, "ignore_eos": True}
    every = _generate(served, n=4, sampling={**sampling, "logprobs": True})
    means = [_mean([p.token.logprob for c in every if c.choice_index == i for p in c.logprobs]) for i in range(4)]
    ranked = sorted(range(4), key=lambda i: (-means[i], i))
    hits_before = _cache_hits(served)
    chunks = _generate(served, n=2, best_of=4, sampling=sampling)
    hits = _cache_hits(served) - hits_before
    # Each returned candidate whole, best first: no interleaving, and choice_index is the rank.
    assert [c.choice_index for c in chunks] == sorted(c.choice_index for c in chunks)
    assert [_ids(chunks, rank) for rank in (0, 1)] == [_ids(every, i) for i in ranked[:2]]
    assert {c.request_id.rsplit("-", 1)[1] for c in chunks if c.choice_index == 0} == {str(ranked[0])}
    assert not any(c.logprobs for c in chunks), "ranked by them, not asked for: not returned"
    lasts = [c for c in chunks if c.finish_reason]
    assert [(c.choice_index, c.usage.completion_tokens) for c in lasts] == [(0, 6), (1, 6)]
    assert chunks[-1].unreturned_completion_tokens == 2 * 6
    # The prompt computed once: the other three candidates found its full blocks in the prefix cache.
    prompt_tokens, block = lasts[0].usage.prompt_tokens, served.block_size
    assert hits >= 3 * (prompt_tokens // block * block - block)


def test_grpc_best_of_below_n_is_invalid_argument(served):
    with pytest.raises(grpc.RpcError) as caught:
        _generate(served, n=3, best_of=2)
    assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                             "best_of must be 0 or in n..16 (3..16), got 2")


# -- guided_grammar ----------------------------------------------------------------------


def test_the_stock_client_sends_guided_grammar_and_gets_its_400(client_seen):
    whole, streamed = client_seen["grammar"], client_seen["grammar_stream"]
    assert all(re.fullmatch(LANGUAGE, text) and reason == "stop" for text, reason in whole), whole
    assert streamed == [text for text, _ in whole]
    bad = client_seen["bad_grammar"]
    assert (bad["status"], bad["param"]) == (400, "guided_grammar")
    assert bad["message"].startswith("sampling.structured: invalid grammar") and 'unknown name: "answer"' in \
        bad["message"]


@pytest.mark.parametrize("grammar", [GBNF, LARK])
def test_guided_grammar_in_either_form_holds_every_seeded_output(served, grammar):
    status, reply = post_json(served.base, "/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 24,
                                                            "temperature": 1.0, "seed": 8, "n": 6,
                                                            "guided_grammar": grammar})
    assert status == 200, reply
    assert all(re.fullmatch(LANGUAGE, c["text"]) and c["finish_reason"] == "stop" for c in reply["choices"]), reply
    assert len({c["text"] for c in reply["choices"]}) > 1


@pytest.mark.parametrize(("grammar", "fragment"), [
    ('root ::= ( "a"', "Failed to convert the grammar from GBNF to Lark"),
    ("start: x\nx: /[a-/", "invalid grammar"),
    ("", "guided_grammar must be a non-empty string"),
])
def test_a_bad_grammar_is_a_400_naming_guided_grammar(served, grammar, fragment):
    status, reply = post_json(served.base, "/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "a"}], "guided_grammar": grammar})
    assert (status, reply["error"]["param"]) == (400, "guided_grammar"), reply
    assert fragment in reply["error"]["message"]


def test_grpc_and_kserve_callers_get_grammars_too(served):
    chunks = _generate(served, sampling={"max_tokens": 24, "temperature": 1.0, "seed": 4,
                                         "structured": common_pb2.StructuredOutput(grammar=LARK)})
    assert re.fullmatch(LANGUAGE, "".join(c.text for c in chunks))
    with pytest.raises(grpc.RpcError) as caught:
        _generate(served, sampling={"structured": common_pb2.StructuredOutput(grammar="start: nope")})
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("sampling.structured: invalid grammar")
    request = kserve.ModelInferRequest(
        model_name=MODEL, id="k-1",
        parameters={"guided_grammar": kserve.InferParameter(string_param=GBNF),
                    "max_tokens": kserve.InferParameter(int64_param=24),
                    "temperature": kserve.InferParameter(double_param=1.0),
                    "seed": kserve.InferParameter(int64_param=4)},
        inputs=[kserve.ModelInferRequest.InferInputTensor(
            name="text_input", datatype="BYTES", shape=[1],
            contents=kserve.InferTensorContents(bytes_contents=[PROMPT.encode()]))])
    with session_tls.channel(served.mesh.gateway.address) as channel:
        responses = list(kserve_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter([request]), timeout=60))
    assert not any(r.error_message for r in responses), responses
    text = "".join(unpack_bytes_tensor(raw)[0].decode() for r in responses
                   for raw in r.infer_response.raw_output_contents)
    assert re.fullmatch(LANGUAGE, text)


# -- parallel_tool_calls -----------------------------------------------------------------


def test_parallel_tool_calls_false_keeps_the_first_of_the_models_calls(client_seen):
    assert client_seen["auto_parallel_True"]["finish_reason"] == "tool_calls"
    assert len(client_seen["auto_parallel_True"]["names"]) == 2
    single = client_seen["auto_parallel_False"]
    assert (single["finish_reason"], single["names"]) == ("tool_calls",
                                                          client_seen["auto_parallel_True"]["names"][:1])
    assert client_seen["auto_stream"] == [[0, single["names"][0]]]  # (index, name) pairs, as JSON lists


@pytest.mark.parametrize("tool_choice", ["", "required"])
def test_grpc_parallel_tool_calls_false_makes_one_call(served, tool_choice):
    structured = {} if tool_choice else {"structured": common_pb2.StructuredOutput(grammar=TWO_CALLS)}
    chunks = _generate(served, messages=[gateway_pb2.ChatMessage(role="user", content="Time?")],
                       tools=[gateway_pb2.Tool(name=t["function"]["name"],
                                               parameters=json.dumps(t["function"]["parameters"])) for t in TOOLS],
                       tool_choice=tool_choice, parallel_tool_calls=False,
                       sampling={"max_tokens": 120, "temperature": 1.0, "seed": 6, **structured})
    assert len(chunks[-1].tool_calls) == 1 and chunks[-1].tool_calls[0].name in ("clock", "weather")

