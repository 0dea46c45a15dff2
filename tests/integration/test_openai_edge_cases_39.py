"""Issue 39's newest options combined and at their edges, through the whole mesh on a tiny Qwen2
checkpoint made here (its chat template offers tools in the Hermes format): echo with n, streamed,
and with best_of; echo with max_tokens 0 when the one token generated upstream is the end of
sequence; prompt_logprobs with n, streamed; best_of with logprobs and a seed; guided_grammar with n,
beside another structured output, and one that matches no string (OpenAI, gRPC, KServe); tool_choice
none with parallel_tool_calls false; bad values (ignore_eos with a grammar too) a 400 naming the
field; token prompts (lm-evaluation-harness's loglikelihood requests) scored as their text is. The stock `openai` client sends what it can (extra_body for vLLM's extras). Nothing compares
against a CPU's float results: values are compared mesh against mesh, or by shape. One mesh for the
module.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import ssl
import urllib.error
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from inference import grpc_predict_v2_pb2 as kserve
from inference import grpc_predict_v2_pb2_grpc as kserve_grpc
from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.support import tool_templates
from tests.support.hf_checkpoints import END_OF_TEXT_ID, EOT_ID
from tests.support.hf_mesh import run_stock_client, serving_hermes_qwen2
from tests.support.https_json import get_json, post_json, post_stream
from tools.testbed import session_tls
from tools.testbed.gateway_fixtures import scrape
from tools.testbed.processes import wait_until
from tools.testbed.scheduler_fixtures import scheduler_stub, wait_for_idle_kv

pytestmark = pytest.mark.integration

MODEL = "tiny-edges"
SIDE_VENV = ("openai", "openai==3.51.0")  # the venv of tests/openai/test_openai_client.py, built once
SCRIPT = Path(__file__).with_name("openai_edge_cases_39_script.py")
PROMPT = "In a hole in the ground there lived a hobbit."
GBNF = 'root ::= answer " " number\nanswer ::= "yes" | "no" | "maybe"\nnumber ::= [1-9] [0-9]?'
LANGUAGE = "(yes|no|maybe) [1-9][0-9]?"
EMPTY_LANGUAGE = "start: start"  # parses and validates, yet no string ends it
TOOLS = [{"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}]
# Two runs of the same computation on the same mesh agree far closer than this.
SAME = 1e-5


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with serving_hermes_qwen2(tmp_path_factory.mktemp("openai-edges"), MODEL,
                              gateway_args=("--enable-tokenizer-info-endpoint",)) as served:
        yield served


@pytest.fixture(scope="module")
def client_seen(served):
    cases = {"prompt": PROMPT, "eos_id": END_OF_TEXT_ID, "empty_grammar": EMPTY_LANGUAGE, "tools": TOOLS}
    return run_stock_client(served, SIDE_VENV, SCRIPT, MODEL, cases)


def _complete(served, **body) -> dict:
    status, reply = post_json(served.base, "/completions", {"model": MODEL, "prompt": PROMPT, **body})
    assert status == 200, reply
    return reply


def _whole_text(text: str) -> bool:
    """A token's or chunk's text usable as a stop string: not blank, and no character its bytes left
    incomplete (random weights draw tokens that split characters; U+FFFD matches no output bytes)."""
    return bool(text.strip()) and "\ufffd" not in text


def _streamed_choices(events: list) -> dict[int, list[dict]]:
    """Each choice's events' choice objects, by index, in order."""
    choices: dict[int, list[dict]] = {}
    for event in events:
        if event != "[DONE]":
            for choice in event["choices"]:
                choices.setdefault(choice["index"], []).append(choice)
    return choices


def _same_logprobs(a: list, b: list) -> bool:
    return len(a) == len(b) and all((x is None) == (y is None) and (x is None or abs(x - y) <= SAME)
                                    for x, y in zip(a, b, strict=True))


# -- echo --------------------------------------------------------------------------------


def test_the_stock_client_reads_echo_with_n_streamed_as_it_does_whole(client_seen):
    whole, streamed = client_seen["echo"], client_seen["echo_stream"]
    assert len(whole["choices"]) == len(streamed) == 2
    for one, other in zip(whole["choices"], streamed, strict=True):
        assert one["text"].startswith(PROMPT) and one["text"] == other["text"]
        assert one["tokens"] == other["tokens"] and one["text_offset"] == other["text_offset"]
        assert one["token_logprobs"][0] is None and _same_logprobs(one["token_logprobs"], other["token_logprobs"])
        assert one["finish_reason"] == other["finish_reason"] == "length"
    # Both choices echo the same prompt, entry for entry; only what follows differs.
    prompt_tokens = whole["usage"]["prompt_tokens"]
    first, second = whole["choices"]
    assert first["tokens"][:prompt_tokens] == second["tokens"][:prompt_tokens]
    assert first["token_logprobs"][:prompt_tokens] == second["token_logprobs"][:prompt_tokens]
    assert whole["usage"]["completion_tokens"] == client_seen["echo_stream_usage"]["completion_tokens"] == 2 * 3


def test_echo_with_best_of_echoes_the_prompt_on_each_of_the_best_candidates(served):
    ask = {"echo": True, "logprobs": 1, "max_tokens": 4, "seed": 5, "temperature": 1.0, "ignore_eos": True}
    every = _complete(served, n=4, **ask)["choices"]
    best = _complete(served, n=2, best_of=4, **ask)
    prompt_tokens = best["usage"]["prompt_tokens"]
    means = [sum(c["logprobs"]["token_logprobs"][prompt_tokens:]) / 4 for c in every]
    ranked = sorted(range(4), key=lambda i: (-means[i], i))
    assert [c["text"] for c in best["choices"]] == [every[i]["text"] for i in ranked[:2]]
    assert all(c["text"].startswith(PROMPT) and len(c["logprobs"]["tokens"]) == prompt_tokens + 4
               for c in best["choices"])
    assert best["usage"]["completion_tokens"] == 4 * 4


def test_echo_with_max_tokens_0_ends_by_length_even_when_the_dropped_token_is_the_end(served, client_seen):
    # logit_bias makes the one token generated upstream the end of sequence: the client still sees
    # the prompt alone, cut by max_tokens 0.
    only = client_seen["echo_only"]
    assert (only["text"], only["finish_reason"], only["usage"]["completion_tokens"]) == (PROMPT, "length", 0)
    status, events = post_stream(served.base, "/completions", {
        "model": MODEL, "prompt": PROMPT, "echo": True, "max_tokens": 0, "stream": True,
        "logit_bias": {str(END_OF_TEXT_ID): 100}})
    choices = _streamed_choices(events)[0]
    assert status == 200 and "".join(c["text"] for c in choices) == PROMPT
    assert [c["finish_reason"] for c in choices][-1] == "length"


@pytest.mark.parametrize(("prompt", "extra", "message"), [
    ([1, 10**9], {}, "prompt[1] is 1000000000, but the model's token ids are 0.."),
    ([[1, 2], [3, -1]], {}, "prompt[1][1] must be a token id (an integer >= 0), got -1"),
    ([], {}, "prompt must not be an empty list"),
    ([PROMPT, ""], {}, "prompt[1] must not be empty"),
    ([PROMPT, 7], {}, "(not a mix)"),
    ([PROMPT] * 1025, {"n": 2}, "1025 prompts x 2 choices each is 2050 sequences; a request may ask for at most 2048"),
])
def test_bad_token_ids_and_bad_batches_are_a_400_naming_prompt(served, prompt, extra, message):
    status, reply = post_json(served.base, "/completions", {"model": MODEL, "prompt": prompt, "echo": True, **extra})
    assert (status, reply["error"]["param"]) == (400, "prompt")
    assert message in reply["error"]["message"]


BATCH = [PROMPT, "Far over the misty mountains cold", PROMPT + " Not a nasty, dirty, wet hole"]


def test_batched_prompts_answer_each_prompt_as_its_own_request_would(served, client_seen):
    # Seeded sampling with echo and logprobs: each prompt's choices are what that prompt alone gets.
    ask = {"n": 2, "max_tokens": 4, "seed": 7, "temperature": 1.0, "echo": True, "logprobs": 1, "ignore_eos": True}
    batch = _complete(served, **{**ask, "prompt": BATCH})
    alone = [_complete(served, **{**ask, "prompt": prompt}) for prompt in BATCH]
    assert [c["index"] for c in batch["choices"]] == list(range(6)), "prompt k's choice i is choice 2k + i"
    for k, single in enumerate(alone):
        for i, want in enumerate(single["choices"]):
            got = batch["choices"][2 * k + i]
            assert got["text"].startswith(BATCH[k]), "echo writes each choice's own prompt"
            assert (got["text"], got["finish_reason"], got["logprobs"]["tokens"]) == (
                want["text"], want["finish_reason"], want["logprobs"]["tokens"])
            assert _same_logprobs(got["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"])
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][key] == sum(single["usage"][key] for single in alone), key
    # Streamed: the same choices by index, one id throughout, the usage summed.
    status, events = post_stream(served.base, "/completions", {"model": MODEL, "prompt": BATCH, "stream": True,
                                                               "stream_options": {"include_usage": True}, **ask})
    assert status == 200
    streamed = _streamed_choices(events)
    assert sorted(streamed) == list(range(6))
    assert ["".join(c["text"] for c in streamed[i]) for i in range(6)] == [c["text"] for c in batch["choices"]]
    assert len({event["id"] for event in events if event != "[DONE]"}) == 1
    assert [e for e in events if e != "[DONE]" and e.get("usage")][-1]["usage"]["completion_tokens"] == \
        batch["usage"]["completion_tokens"]
    # The stock client: its types parse the batch (two prompts x n=2, numbered prompt after prompt).
    seen = client_seen["batch"]
    assert [c["index"] for c in seen["choices"]] == [0, 1, 2, 3]
    assert seen["usage"]["completion_tokens"] == 12 and seen["id"].startswith("cmpl-")


def test_batches_past_what_the_gateway_admits_at_once_are_served_in_turns(served):
    """100 prompts whole, and 20 prompts x n=4 streamed: each sequence is admitted on its own, and the
    model's default adaptive limit (64) leaves 57 places to standard traffic. The sequences take turns (at
    most 64 in flight; one shed while its siblings run waits for one of them to end, turns.py); before,
    the request's own sequences refused it: a 503 `overloaded` from 58 of them on, on an idle mesh."""
    prompts = [f"{k}: {PROMPT}" for k in range(100)]
    status, reply = post_json(served.base, "/completions", {"model": MODEL, "prompt": prompts, "max_tokens": 2,
                                                            "echo": True})
    assert status == 200, reply
    assert [c["index"] for c in reply["choices"]] == list(range(100))
    assert all(c["text"].startswith(prompts[k]) for k, c in enumerate(reply["choices"])), "prompt after prompt"
    status, events = post_stream(served.base, "/completions", {
        "model": MODEL, "prompt": prompts[:20], "n": 4, "max_tokens": 3, "ignore_eos": True, "temperature": 1.0,
        "seed": 3, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and events[-1] == "[DONE]"
    streamed = _streamed_choices(events)
    assert sorted(streamed) == list(range(80))
    assert all(choices[-1]["finish_reason"] == "length" for choices in streamed.values())
    assert [e for e in events if e != "[DONE]" and e.get("usage")][-1]["usage"]["completion_tokens"] == 80 * 3
    assert len({event["id"] for event in events if event != "[DONE]"}) == 1


def test_a_client_that_leaves_a_streamed_batch_cancels_every_sequence_and_frees_their_kv(served):
    """20 prompts x n=4 streamed, long: the client reads the first event and goes away. Every sequence,
    running or waiting its turn, is cancelled: the scheduler's KV blocks all come free, and the mesh then
    answers the next batch."""
    model = common_pb2.ModelRef(name=MODEL, version="1")

    def counted(code: str) -> float:
        return scrape(served.metrics_port).value("infermesh_scheduler_requests_total", model=MODEL, code=code)

    before = {code: counted(code) for code in ("OK", "CANCELLED")}
    body = json.dumps({"model": MODEL, "prompt": [f"{k}: {PROMPT}" for k in range(20)], "n": 4, "max_tokens": 1500,
                       "ignore_eos": True, "stream": True})
    url = urllib.parse.urlsplit(served.base)
    connection = http.client.HTTPSConnection(url.hostname, url.port, timeout=60, context=ssl.create_default_context(
        cafile=str(session_tls.session_pki().ca_path)))
    with scheduler_stub(served.mesh.scheduler.address) as stub:
        try:
            connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            answer = connection.getresponse()
            assert answer.status == 200 and answer.readline().startswith(b"data: ")
        finally:
            connection.close()  # the client goes away mid-stream
        wait_for_idle_kv(stub, model, timeout_s=30)
    wait_until(lambda: counted("CANCELLED") > before["CANCELLED"], timeout_s=10, message="sequences counted cancelled")
    cancelled, served_ok = counted("CANCELLED") - before["CANCELLED"], counted("OK") - before["OK"]
    assert cancelled >= 1 and cancelled + served_ok <= 80, (cancelled, served_ok)
    status, reply = post_json(served.base, "/completions", {"model": MODEL, "prompt": [PROMPT] * 70, "max_tokens": 1})
    assert status == 200 and len(reply["choices"]) == 70


# -- prompt_logprobs and best_of ---------------------------------------------------------


def test_prompt_logprobs_with_n_streamed_come_once_per_choice_as_whole(served):
    ask = {"prompt_logprobs": 2, "n": 3, "max_tokens": 2, "seed": 1}
    whole = _complete(served, **ask)["choices"]
    status, events = post_stream(served.base, "/completions", {"model": MODEL, "prompt": PROMPT, "stream": True,
                                                               **ask})
    streamed = _streamed_choices(events)
    assert status == 200 and sorted(streamed) == [0, 1, 2]
    for index, choices in streamed.items():
        carried = [c["prompt_logprobs"] for c in choices if "prompt_logprobs" in c]
        assert len(carried) == 1 and carried == [choices[0]["prompt_logprobs"]], "the first event alone"
        ours, theirs = carried[0], whole[index]["prompt_logprobs"]
        assert ours[0] is None and theirs[0] is None
        assert [list(p) for p in ours[1:]] == [list(p) for p in theirs[1:]]  # the same token ids, in rank order
        assert _same_logprobs([e["logprob"] for p in ours[1:] for e in p.values()],
                              [e["logprob"] for p in theirs[1:] for e in p.values()])


def test_the_stock_client_reads_chat_prompt_logprobs_once_per_choice_streamed(client_seen):
    whole, streamed = client_seen["chat_prompt_logprobs"], client_seen["chat_prompt_logprobs_stream"]
    carried = [p for p in streamed if p is not None]
    assert len(carried) == 2 and carried[0] == carried[1]  # one per choice: each choice's first event
    assert carried[0][0] is None and [list(p) for p in carried[0][1:]] == [list(p) for p in whole[1:]]


def test_best_of_with_logprobs_and_a_seed_is_reproducible(served):
    ask = {"n": 2, "best_of": 5, "logprobs": 3, "seed": 77, "max_tokens": 6, "temperature": 1.0,
           "ignore_eos": True}
    once, again = _complete(served, **ask), _complete(served, **ask)
    assert [c["text"] for c in once["choices"]] == [c["text"] for c in again["choices"]]
    for one, other in zip(once["choices"], again["choices"], strict=True):
        assert one["logprobs"]["tokens"] == other["logprobs"]["tokens"]
        assert _same_logprobs(one["logprobs"]["token_logprobs"], other["logprobs"]["token_logprobs"])
        assert all(1 <= len(top) <= 4 for top in one["logprobs"]["top_logprobs"])
    assert once["usage"]["completion_tokens"] == 5 * 6


def _generate(served, **fields) -> list[gateway_pb2.GenerateResponse]:
    sampling = fields.pop("sampling", {})
    if "prompt_token_ids" not in fields:
        fields.setdefault("prompt", PROMPT)
    request = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name=MODEL), **fields,
                                          sampling=common_pb2.SamplingParams(**sampling))
    with session_tls.channel(served.mesh.gateway.address) as channel:
        return list(gateway_pb2_grpc.InferenceStub(channel).Generate(request, timeout=60))


def _positions(positions) -> list[tuple]:
    return [(p.token.token_id, None if math.isnan(p.token.logprob) else p.token.logprob,
             [t.token_id for t in p.top]) for p in positions]


def test_grpc_best_of_puts_the_prompts_logprobs_on_its_first_chunk_alone(served):
    chunks = _generate(served, n=2, best_of=3, sampling={"max_tokens": 3, "seed": 4, "temperature": 1.0,
                                                         "prompt_logprobs": 2})
    plain = _generate(served, sampling={"max_tokens": 1, "prompt_logprobs": 2})
    assert chunks[0].prompt_logprobs and not any(c.prompt_logprobs for c in chunks[1:])
    ours, theirs = _positions(chunks[0].prompt_logprobs), _positions(plain[0].prompt_logprobs)
    assert [(i, top) for i, _, top in ours] == [(i, top) for i, _, top in theirs]
    assert _same_logprobs([lp for _, lp, _ in ours], [lp for _, lp, _ in theirs])
    assert not any(c.logprobs for c in chunks), "ranked by them, not asked for: not returned"


# -- guided_grammar ----------------------------------------------------------------------


def test_guided_grammar_holds_every_choice_of_n_streamed(served):
    status, events = post_stream(served.base, "/completions", {
        "model": MODEL, "prompt": PROMPT, "guided_grammar": GBNF, "n": 4, "seed": 3, "max_tokens": 20,
        "temperature": 1.0, "stream": True})
    streamed = _streamed_choices(events)
    assert status == 200 and sorted(streamed) == [0, 1, 2, 3]
    for choices in streamed.values():
        assert re.fullmatch(LANGUAGE, "".join(c["text"] for c in choices)) and choices[-1]["finish_reason"] == "stop"


@pytest.mark.parametrize("other", [{"response_format": {"type": "json_object"}}, {"guided_regex": "a+"},
                                   {"guided_choice": ["yes"]}])
def test_guided_grammar_beside_another_structured_output_is_a_400(served, other):
    status, reply = post_json(served.base, "/completions", {"model": MODEL, "prompt": PROMPT,
                                                            "guided_grammar": GBNF, **other})
    assert (status, reply["error"]["param"]) == (400, "guided_grammar")
    assert reply["error"]["message"].startswith("set one of response_format, guided_json, guided_regex")


def test_a_grammar_that_matches_no_string_is_refused_on_every_front(served, client_seen):
    refused = client_seen["empty_grammar"]
    assert (refused["status"], refused["param"]) == (400, "guided_grammar")
    assert "it matches no string" in refused["message"]
    status, reply = post_json(served.base, "/completions", {"model": MODEL, "prompt": PROMPT,
                                                            "guided_regex": "[^\\x00-\\U0010FFFF]"})
    assert (status, reply["error"]["param"]) == (400, "guided_regex") and "it matches no string" in \
        reply["error"]["message"]
    with pytest.raises(grpc.RpcError) as caught:
        _generate(served, sampling={"structured": common_pb2.StructuredOutput(grammar=EMPTY_LANGUAGE)})
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("sampling.structured: invalid grammar: it matches no string")
    request = kserve.ModelInferRequest(
        model_name=MODEL, id="k-1", parameters={"guided_grammar": kserve.InferParameter(string_param=EMPTY_LANGUAGE)},
        inputs=[kserve.ModelInferRequest.InferInputTensor(
            name="text_input", datatype="BYTES", shape=[1],
            contents=kserve.InferTensorContents(bytes_contents=[PROMPT.encode()]))])
    with session_tls.channel(served.mesh.gateway.address) as channel:
        responses = list(kserve_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter([request]), timeout=60))
    assert [r.error_message.split(": it matches")[0] for r in responses] == [
        "parameter 'guided_grammar': sampling.structured: invalid grammar"]


@pytest.mark.parametrize(("body", "param"), [
    ({"echo": "true"}, "echo"), ({"best_of": 0}, "best_of"), ({"best_of": -1}, "best_of"),
    ({"best_of": 10**30}, "best_of"), ({"best_of": 2.0}, "best_of"), ({"n": 3, "best_of": 2}, "best_of"),
    ({"prompt_logprobs": True}, "prompt_logprobs"), ({"prompt_logprobs": 1.0}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"guided_grammar": ""}, "guided_grammar"),
    ({"guided_grammar": 'start: "a"\n' + "// padding\n" * 7000}, "guided_grammar"),
    ({"guided_grammar": "\u0000\u0001\u00ff"}, "guided_grammar"), ({"guided_grammar": ["start: \"a\""]}, "guided_grammar"),
    ({"parallel_tool_calls": "false"}, "parallel_tool_calls"), ({"ignore_eos": True, "guided_grammar": GBNF}, "ignore_eos"),
    ({"allowed_token_ids": [10**6]}, "allowed_token_ids"), ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": ["x" * 300]}, "bad_words"),  # past the vocabulary, the byte cap: the scheduler's refusals
])
def test_bad_values_are_a_400_naming_the_field(served, body, param):
    status, reply = post_json(served.base, "/completions", {"model": MODEL, "prompt": PROMPT, **body})
    assert (status, reply["error"]["param"]) == (400, param), reply


# -- tools -------------------------------------------------------------------------------


def test_tool_choice_none_with_parallel_tool_calls_false_answers_in_content(client_seen):
    assert client_seen["tools_none"]["tool_calls"] is None
    assert isinstance(client_seen["tools_none"]["content"], str)


# -- a grammar that forces an endless sequence --------------------------------------------


ENDLESS = 'root ::= "a" root'  # parses, matches "a"s without end: llguidance hits its item limit while sampling


def _streamed_error(base: str, body: dict) -> tuple[int, dict]:
    """A streamed request's (status, error object): a refusal before the first event, or its last event."""
    try:
        status, events = post_stream(base, "/completions", body)
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())["error"]
    return status, events[-1]["error"]


def test_a_grammar_forcing_an_endless_sequence_is_the_callers_400_on_every_front_and_others_go_on(served):
    ask = {"model": MODEL, "prompt": PROMPT, "guided_grammar": ENDLESS, "max_tokens": 16}
    with ThreadPoolExecutor(2) as pool:
        beside = pool.submit(post_json, served.base, "/completions", {"model": MODEL, "prompt": PROMPT,
                                                                      "max_tokens": 16, "ignore_eos": True})
        status, reply = post_json(served.base, "/completions", ask)
        assert beside.result()[0] == 200 and beside.result()[1]["usage"]["completion_tokens"] == 16
    error = reply["error"]
    assert (status, error["type"], error["param"]) == (400, "invalid_request_error", "guided_grammar"), reply
    assert error["message"].startswith("sampling.structured: the grammar cannot go on") and "<state>" not in \
        error["message"] and len(error["message"]) < 300
    status, streamed = _streamed_error(served.base, {**ask, "stream": True})
    assert status in (200, 400) and streamed["param"] == "guided_grammar", streamed  # 400: failed by the first chunk
    with pytest.raises(grpc.RpcError) as caught:
        _generate(served, sampling={"max_tokens": 16, "structured": common_pb2.StructuredOutput(grammar=ENDLESS)})
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == error["message"]
    request = kserve.ModelInferRequest(
        model_name=MODEL, id="k-2", parameters={"guided_grammar": kserve.InferParameter(string_param=ENDLESS),
                                                "max_tokens": kserve.InferParameter(int64_param=16)},
        inputs=[kserve.ModelInferRequest.InferInputTensor(
            name="text_input", datatype="BYTES", shape=[1],
            contents=kserve.InferTensorContents(bytes_contents=[PROMPT.encode()]))])
    with session_tls.channel(served.mesh.gateway.address) as channel:
        responses = list(kserve_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter([request]), timeout=60))
    assert responses[-1].error_message == f"parameter 'guided_grammar': {error['message']}"


def test_a_grammar_forcing_an_endless_sequence_ends_by_length_when_max_tokens_comes_first(served):
    reply = _complete(served, guided_grammar=ENDLESS, max_tokens=1)
    assert (reply["choices"][0]["text"], reply["choices"][0]["finish_reason"]) == ("a", "length")


# -- context length and stop strings: the 400 names the field -------------------------------


def test_a_prompt_and_max_tokens_over_the_context_name_max_tokens(served):
    status, reply = post_json(served.base, "/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4096})
    assert (status, reply["error"]["param"], reply["error"]["code"]) == (400, "max_tokens", "context_length_exceeded")


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/completions", {"prompt": "hobbit " * 3000}, "prompt"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hobbit " * 3000}]}, "messages"),
])
def test_a_prompt_over_the_context_names_the_prompt(served, path, body, param):
    status, reply = post_json(served.base, path, {"model": MODEL, **body})
    assert (status, reply["error"]["param"], reply["error"]["code"]) == (400, param, "context_length_exceeded")


def test_a_stop_string_over_the_schedulers_byte_cap_names_stop(served):
    status, reply = post_json(served.base, "/completions", {"model": MODEL, "prompt": PROMPT, "stop": "é" * 200})
    assert (status, reply["error"]["param"]) == (400, "stop"), reply


# -- token prompts (lm-evaluation-harness's loglikelihood requests) ----------------------


def _prompt_ids(served, prompt: str) -> list[int]:
    """The prompt's token ids as the model's tokenizer makes them (the prompt's logprobs name them)."""
    chunks = _generate(served, prompt=prompt, sampling={"max_tokens": 1, "prompt_logprobs": 0})
    return [p.token.token_id for p in chunks[0].prompt_logprobs]


def test_token_prompts_score_as_their_text_does_in_lm_evals_loglikelihood_request(served):
    """lm-evaluation-harness's local-completions scores a context and its continuation with the
    tokens it made itself: prompts as lists of token ids, echo, logprobs 1, max_tokens 1."""
    texts = [PROMPT, "Far over the misty mountains cold"]
    ids = [_prompt_ids(served, text) for text in texts]
    ask = {"temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    by_ids = _complete(served, **{**ask, "prompt": ids})
    by_text = _complete(served, **{**ask, "prompt": texts})
    assert by_ids["usage"] == by_text["usage"]
    assert by_ids["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
    for got, want, prompt_ids in zip(by_ids["choices"], by_text["choices"], ids, strict=True):
        assert got["text"] == want["text"] and got["text"].startswith(texts[got["index"]])
        assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        assert _same_logprobs(got["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"])
        # What lm-eval reads: the continuation's logprobs (ctxlen: here the context is all but the last two
        # tokens) and whether each was the greedy one.
        ctxlen = len(prompt_ids) - 2
        scored = got["logprobs"]["token_logprobs"][ctxlen:-1]
        assert len(scored) == 2 and all(math.isfinite(x) and x <= 0 for x in scored)
        assert all(isinstance(top, dict) and top for top in got["logprobs"]["top_logprobs"][ctxlen:-1])


def test_a_token_prompt_streams_what_its_text_streams(served):
    ids = _prompt_ids(served, PROMPT)
    ask = {"temperature": 0, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
    streamed = {}
    for key, prompt in (("ids", ids), ("text", PROMPT)):
        status, events = post_stream(served.base, "/completions", {"model": MODEL, "prompt": prompt, **ask})
        assert status == 200
        streamed[key] = ("".join(c["text"] for c in _streamed_choices(events)[0]),
                         [e for e in events if e != "[DONE]" and e.get("usage")][-1]["usage"])
    assert streamed["ids"] == streamed["text"] and streamed["ids"][1]["prompt_tokens"] == len(ids)


def test_kserves_generate_takes_the_prompt_as_input_ids_and_answers_as_for_its_text(served):
    root = served.base.removesuffix("/v1")
    ids = _prompt_ids(served, PROMPT)
    parameters = {"max_tokens": 6, "temperature": 0}
    answers = [post_json(root, f"/v2/models/{MODEL}/generate", {**prompt, "parameters": parameters})
               for prompt in ({"input_ids": ids}, {"text_input": PROMPT})]
    assert [status for status, _ in answers] == [200, 200], answers
    by_ids, by_text = (reply for _, reply in answers)
    assert by_ids["text_output"] == by_text["text_output"] and by_ids["text_output"]
    assert by_ids["parameters"]["prompt_tokens"] == by_text["parameters"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize(("body", "fragment"), [
    ({"input_ids": [1, 10**9]}, "input 'input_ids'[1] is 1000000000, but the model's token ids are 0.."),
    ({"input_ids": [1], "text_input": "a"}, "send 'text_input' (the prompt's text) or 'input_ids'"),
    ({"input_ids": []}, "'input_ids' must be a non-empty list of token ids"),
])
def test_bad_input_ids_on_kserves_generate_are_a_400_naming_them(served, body, fragment):
    status, reply = post_json(served.base.removesuffix("/v1"), f"/v2/models/{MODEL}/generate", body)
    assert status == 400 and fragment in reply["error"], reply


# -- vLLM's /tokenize and /detokenize --------------------------------------------------------


def test_tokenize_gives_the_ids_generate_computes_from_and_detokenize_the_text_back(served):
    root = served.base.removesuffix("/v1")
    ids = _prompt_ids(served, PROMPT)
    status, reply = post_json(root, "/tokenize", {"model": MODEL, "prompt": PROMPT, "return_token_strs": True})
    assert status == 200, reply
    assert (reply["tokens"], reply["count"], reply["max_model_len"]) == (ids, len(ids), 2048)
    assert "".join(reply["token_strs"]) == PROMPT
    assert post_json(root, "/detokenize", {"model": MODEL, "tokens": ids}) == (200, {"prompt": PROMPT})
    # What lm-evaluation-harness's remote tokenizer sends: no model (the mesh serves one here), no special
    # tokens (this checkpoint's tokenizer puts a BOS first, which spells nothing).
    assert reply["token_strs"][0] == ""
    status, unnamed = post_json(root, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert (status, unnamed["tokens"]) == (200, ids[1:])
    assert post_json(root, "/detokenize", {"tokens": ids[1:]}) == (200, {"prompt": PROMPT})
    # A conversation: the template's tokens, as many as chat counts in its usage.
    messages = [{"role": "user", "content": "What time is it?"}]
    status, chat = post_json(root, "/tokenize", {"model": MODEL, "messages": messages, "tools": TOOLS})
    answered, asked = post_json(served.base, "/chat/completions",
                                {"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 1})
    assert status == answered == 200 and chat["count"] == asked["usage"]["prompt_tokens"]
    status, bare = post_json(root, "/tokenize", {"model": MODEL, "messages": messages, "add_generation_prompt": False})
    assert status == 200 and bare["count"] < chat["count"]


def test_tokenizer_info_gives_what_tokenizer_config_json_says_as_vllm_serves_it(served):
    """Served behind --enable-tokenizer-info-endpoint (this mesh's gateway has it), as in vLLM."""
    root = served.base.removesuffix("/v1")
    status, info = get_json(root, "/tokenizer_info")  # no model: the mesh's only one, as vLLM's
    assert status == 200, info
    assert (info["tokenizer_class"], info["model_max_length"]) == ("PreTrainedTokenizerFast", 2048)
    assert info["chat_template"] == tool_templates.HERMES and info["eos_token"]
    assert get_json(root, f"/tokenizer_info?model={MODEL}") == (200, info)
    status, refused = get_json(root, "/tokenizer_info?model=nope")
    assert status == 404, refused


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"model": MODEL}, 400, "prompt"),
    ("/tokenize", {"model": "nope", "prompt": "a"}, 404, None),
    ("/detokenize", {"model": MODEL, "tokens": [1, 10**9]}, 400, None),
    ("/detokenize", {"model": MODEL, "tokens": "1 2"}, 400, "tokens"),
])
def test_bad_tokenize_and_detokenize_bodies_are_refused_in_openais_shape(served, path, body, status, param):
    got, reply = post_json(served.base.removesuffix("/v1"), path, body)
    assert (got, reply["error"]["param"]) == (status, param), reply


# -- vLLM's top_k and min_p ------------------------------------------------------------------


def test_top_k_and_min_p_cut_what_the_worker_draws_from(served):
    ask = {"max_tokens": 24, "ignore_eos": True}
    greedy = _complete(served, temperature=0, **ask)["choices"][0]["text"]
    assert _complete(served, temperature=2.0, seed=3, **ask)["choices"][0]["text"] != greedy, "a draw, uncut"
    for cut in ({"top_k": 1}, {"min_p": 1.0}):
        assert _complete(served, temperature=2.0, seed=3, **ask, **cut)["choices"][0]["text"] == greedy, cut
    # top_k 2: every token drawn is one of the two most likely there (the logprobs reported are before the cut).
    for seed in range(3):
        logprobs = _complete(served, temperature=2.0, seed=seed, top_k=2, logprobs=2, **ask)["choices"][0]["logprobs"]
        assert all(token in top for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True))


# -- vLLM's min_tokens -----------------------------------------------------------------------


def test_min_tokens_holds_off_the_end_of_sequence_and_stop_strings(served):
    ends = {str(END_OF_TEXT_ID): -100, str(EOT_ID): -100}  # both end ids of the checkpoint's generation_config
    # Greedy with the end forced at once: an empty output; with min_tokens 5, the five tokens greedy
    # draws when neither end id may be drawn, then the end.
    forced = {"temperature": 0, "max_tokens": 16, "logit_bias": {str(END_OF_TEXT_ID): 100}}
    assert _complete(served, **forced)["choices"][0] | {"logprobs": None} == \
        {"index": 0, "text": "", "finish_reason": "stop", "logprobs": None, "stop_reason": None}
    held = _complete(served, min_tokens=5, **forced)
    free = _complete(served, temperature=0, max_tokens=5, logit_bias=ends, ignore_eos=True)
    assert (held["choices"][0]["text"], held["choices"][0]["finish_reason"]) == (free["choices"][0]["text"], "stop")
    assert held["usage"]["completion_tokens"] - _complete(served, **forced)["usage"]["completion_tokens"] == 5
    # A stop string, a token's text, ends the output where it first appears; with min_tokens 3 tokens
    # past that token it is looked for only where it ends after them, so the first one is kept.
    greedy = _complete(served, temperature=0, max_tokens=24, ignore_eos=True, logit_bias=ends, logprobs=0)
    tokens = greedy["choices"][0]["logprobs"]["tokens"]
    first = next(t for t in tokens if _whole_text(t))
    plain = {"temperature": 0, "max_tokens": 24, "logit_bias": ends, "stop": [first]}
    cut = greedy["choices"][0]["text"].index(first)
    stopped = _complete(served, **plain)["choices"][0]
    assert (stopped["text"], stopped["stop_reason"]) == (greedy["choices"][0]["text"][:cut], first)  # vLLM's field
    late = _complete(served, min_tokens=3 + tokens.index(first), **plain)["choices"][0]["text"]
    assert greedy["choices"][0]["text"].startswith(late) and len(late) >= cut + len(first)  # the stop's text, kept
    status, reply = post_json(served.base, "/completions", {"model": MODEL, "prompt": PROMPT, "min_tokens": 300})
    assert (status, reply["error"]["param"]) == (400, "min_tokens"), reply  # past the default max_tokens


# -- vLLM's chat options ---------------------------------------------------------------------


def test_continue_final_message_continues_the_assistants_turn_as_its_token_prompt_does(served):
    messages = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "Once upon"}]
    opened = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    status, tokenized = post_json(served.base.removesuffix("/v1"), "/tokenize", {"model": MODEL, **opened})
    assert status == 200, tokenized
    greedy = {"model": MODEL, "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    status, chat = post_json(served.base, "/chat/completions", {**greedy, **opened})
    assert status == 200, chat
    status, completion = post_json(served.base, "/completions", {**greedy, "prompt": tokenized["tokens"]})
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]
    assert chat["usage"]["prompt_tokens"] == tokenized["count"]
    status, closed = post_json(served.base.removesuffix("/v1"), "/tokenize",
                               {"model": MODEL, "messages": messages, "add_generation_prompt": False})
    assert closed["tokens"][:tokenized["count"]] == tokenized["tokens"] and closed["count"] > tokenized["count"]


@pytest.mark.parametrize(("body", "param"), [
    ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt defaults to true
    ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),  # the scheduler's refusal
])
def test_bad_chat_options_are_400s_naming_them(served, body, param):
    status, reply = post_json(served.base, "/chat/completions",
                              {"model": MODEL, "messages": [{"role": "user", "content": "a"}], **body})
    assert (status, reply["error"]["param"]) == (400, param), reply


def test_stop_token_ids_end_the_output_and_include_stop_str_in_output_keeps_the_stop(served):
    banned = {END_OF_TEXT_ID: -100, EOT_ID: -100}  # both end ids of the checkpoint's generation_config
    free = {"max_tokens": 12, "ignore_eos": True, "logit_bias": banned}
    chunks = _generate(served, sampling=free)
    ids = [t for c in chunks for t in c.token_ids]
    k = ids.index(ids[2])  # where the third token's id first comes
    cut = _generate(served, sampling={**free, "stop_token_ids": [ids[2]]})
    assert [t for c in cut for t in c.token_ids] == ids[:k]  # counted, not streamed, as an end id
    assert cut[-1].finish_reason == common_pb2.FINISH_REASON_EOS and cut[-1].usage.completion_tokens == k + 1
    http = _complete(served, temperature=0, max_tokens=12, ignore_eos=True,
                     logit_bias={str(t): b for t, b in banned.items()}, stop_token_ids=[ids[2]])
    assert (http["choices"][0]["text"], http["choices"][0]["finish_reason"]) == ("".join(c.text for c in cut), "stop")
    assert http["choices"][0]["stop_reason"] == ids[2]  # vLLM's: the stop id that ended it
    kept = _generate(served, sampling={**free, "stop_token_ids": [ids[2]], "include_stop_str_in_output": True})
    assert [t for c in kept for t in c.token_ids] == ids[:k + 1]
    # A stop string kept in the text: it ends the output after the stop instead of before.
    text = "".join(c.text for c in chunks)
    first = next(c.text for c in chunks if _whole_text(c.text))
    stopped = _generate(served, sampling={**free, "stop": [first], "include_stop_str_in_output": True})
    assert "".join(c.text for c in stopped) == text[:text.index(first) + len(first)]


def test_truncate_prompt_tokens_and_add_special_tokens_shape_the_prompt_as_tokenize_counts_it(served):
    root = served.base.removesuffix("/v1")
    greedy = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    for special in (True, False):
        status, ids = post_json(root, "/tokenize", {"model": MODEL, "prompt": PROMPT, "add_special_tokens": special})
        assert status == 200, ids
        reply = _complete(served, add_special_tokens=special, **greedy)
        assert reply["usage"]["prompt_tokens"] == ids["count"]
    status, ids = post_json(root, "/tokenize", {"model": MODEL, "prompt": PROMPT})
    cut = _complete(served, truncate_prompt_tokens=5, logprobs=0, **greedy)
    tail = _complete(served, **{**greedy, "prompt": ids["tokens"][-5:]}, logprobs=0)
    assert cut["usage"]["prompt_tokens"] == 5 and cut["choices"][0]["text"] == tail["choices"][0]["text"]
    status, reply = post_json(served.base, "/completions", {"model": MODEL, "prompt": PROMPT, "truncate_prompt_tokens": 4096})
    assert (status, reply["error"]["param"]) == (400, "truncate_prompt_tokens"), reply  # past the model's context


def test_return_token_ids_gives_the_prompts_and_every_generated_token_the_end_included(served):
    root = served.base.removesuffix("/v1")
    status, ids = post_json(root, "/tokenize", {"model": MODEL, "prompt": PROMPT})
    ended = {"temperature": 0, "max_tokens": 8, "min_tokens": 3, "logit_bias": {str(END_OF_TEXT_ID): 100},
             "return_token_ids": True}
    whole = _complete(served, **ended)
    choice = whole["choices"][0]
    assert choice["prompt_token_ids"] == ids["tokens"]
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"] == 4 and choice["token_ids"][-1] == END_OF_TEXT_ID
    grpc_ids = [t for c in _generate(served, sampling={"max_tokens": 8, "min_tokens": 3,
                                                         "logit_bias": {END_OF_TEXT_ID: 100}}) for t in c.token_ids]
    assert choice["token_ids"][:-1] == grpc_ids  # the end is counted, never streamed as a token of the text
    status, events = post_stream(served.base, "/completions", {"model": MODEL, "prompt": PROMPT, "stream": True, **ended})
    choices = [e["choices"][0] for e in events if e != "[DONE]"]
    assert [t for c in choices for t in c["token_ids"]] == choice["token_ids"]
    assert choices[0]["prompt_token_ids"] == ids["tokens"] and all("prompt_token_ids" not in c for c in choices[1:])
    messages = [{"role": "user", "content": PROMPT}]
    status, chat_ids = post_json(root, "/tokenize", {"model": MODEL, "messages": messages})
    status, chat = post_json(served.base, "/chat/completions", {"model": MODEL, "messages": messages, **ended})
    assert chat["prompt_token_ids"] == chat_ids["tokens"] and chat["choices"][0]["token_ids"][-1] == END_OF_TEXT_ID
    status, events = post_stream(served.base, "/chat/completions",
                                 {"model": MODEL, "messages": messages, "stream": True, **ended})
    chunks = [e for e in events if e != "[DONE]"]
    assert chunks[0]["prompt_token_ids"] == chat_ids["tokens"]
    assert [t for e in chunks for t in e["choices"][0]["token_ids"]] == chat["choices"][0]["token_ids"]


def _one_token_word(root: str, token_id: int) -> str | None:
    """The token's text when it is a word that bad_words tokenizes (bare or after a space) to that token alone."""
    status, reply = post_json(root, "/detokenize", {"model": MODEL, "tokens": [token_id]})
    word = reply["prompt"].lstrip()
    if status != 200 or not _whole_text(word):
        return None
    for text in (word, " " + word):
        status, ids = post_json(root, "/tokenize", {"model": MODEL, "prompt": text, "add_special_tokens": False})
        if status == 200 and ids["tokens"] == [token_id]:
            return word
    return None


def test_allowed_token_ids_and_bad_words_shape_a_greedy_output(served):
    root = served.base.removesuffix("/v1")
    greedy = {"temperature": 0, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
    ids = _complete(served, **greedy)["choices"][0]["token_ids"]
    allowed = sorted({ids[1], ids[4], ids[6]})  # ids the model takes up after this prompt
    only = _complete(served, **greedy, allowed_token_ids=allowed)["choices"][0]["token_ids"]
    assert len(only) == 8 and set(only) <= set(allowed)
    # The 3rd token (or the first later one that is a one-token word new to the output) as a bad word.
    k, word = next((k, w) for k in range(2, len(ids)) if ids[k] not in ids[:k]
                   and (w := _one_token_word(root, ids[k])) is not None)
    banned = _complete(served, **greedy, bad_words=[word])["choices"][0]["token_ids"]
    assert banned[:k] == ids[:k] and banned[k] != ids[k] and ids[k] not in banned
