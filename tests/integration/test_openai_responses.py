"""OpenAI's Responses API (POST /v1/responses) through the whole mesh on a tiny Qwen2 checkpoint made here
(Hermes tool calls), as the stock `openai` client reads it: what it answers is what chat completions
answer for the same conversation (greedy), streamed as whole, with function calls, a structured
output, the token limit and the refusals. Values are compared mesh against mesh, never against a
CPU's float results. One mesh for the module.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.hf_checkpoints import END_OF_TEXT_ID
from tests.support.hf_mesh import run_stock_client, serving_hermes_qwen2
from tests.support.https_json import post_json

pytestmark = pytest.mark.integration

MODEL = "tiny-responses"
SIDE_VENV = ("openai", "openai==3.51.0")  # the venv of tests/openai/test_openai_client.py, built once
SCRIPT = Path(__file__).with_name("openai_responses_script.py")
PROMPT = "In a hole in the ground there lived a hobbit."
TOOLS = [{"type": "function", "name": "clock", "description": "The time now.",
          "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}]
# The end of text forced, held off for 6 tokens: greedy outputs that end (status completed).
ENDS_AFTER_6 = {"min_tokens": 6, "logit_bias": {str(END_OF_TEXT_ID): 100}}
SCHEMA = {"type": "object", "properties": {"pick": {"enum": ["left", "right"]}}, "required": ["pick"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with serving_hermes_qwen2(tmp_path_factory.mktemp("responses"), MODEL) as served:
        yield served


@pytest.fixture(scope="module")
def client_seen(served):
    cases = {"prompt": PROMPT, "tools": TOOLS, "schema": SCHEMA, "ends_after_6": ENDS_AFTER_6}
    return run_stock_client(served, SIDE_VENV, SCRIPT, MODEL, cases)


def _chat(served, **body) -> dict:
    status, reply = post_json(served.base, "/chat/completions", {"model": MODEL, "temperature": 0, **ENDS_AFTER_6,
                                                                 **body})
    assert status == 200, reply
    return reply


def test_a_response_says_what_chat_says_for_the_same_conversation(served, client_seen):
    chat = _chat(served, messages=[{"role": "user", "content": PROMPT}], max_completion_tokens=12)
    seen = client_seen["text"]
    assert seen["output_text"] == chat["choices"][0]["message"]["content"]
    response = seen["response"]
    assert (response["object"], response["model"], response["store"]) == ("response", MODEL, False)
    assert (response["status"], chat["choices"][0]["finish_reason"], response["incomplete_details"]) == \
        ("completed", "stop", None)
    usage = response["usage"]
    assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == \
        (chat["usage"]["prompt_tokens"], chat["usage"]["completion_tokens"], chat["usage"]["total_tokens"])
    (message,) = response["output"]
    assert (message["type"], message["role"], message["status"]) == ("message", "assistant", "completed")
    with_system = _chat(served, max_completion_tokens=12, messages=[{"role": "system", "content": "Answer briefly."},
                                                                    {"role": "user", "content": PROMPT}])
    assert client_seen["instructions"] == with_system["choices"][0]["message"]["content"]


def test_the_stream_helper_builds_the_same_response_from_ordered_events(client_seen):
    streamed, whole = client_seen["stream"], client_seen["text"]
    assert streamed["output_text"] == whole["output_text"]
    counted = ("input_tokens", "output_tokens", "total_tokens")  # cached_tokens differ: the second one hits the cache
    assert [streamed["response"]["usage"][k] for k in counted] == [whole["response"]["usage"][k] for k in counted]
    types = streamed["types"]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(types[4:-4]) <= {"response.output_text.delta"}


def test_function_calls_are_output_items_and_their_outputs_go_back_as_input(client_seen):
    called = client_seen["called"]
    calls = [item for item in called["output"] if item["type"] == "function_call"]
    assert calls and all(c["name"] == "clock" and c["call_id"] and c["status"] == "completed" for c in calls)
    assert all(isinstance(json.loads(c["arguments"]), dict) for c in calls)
    assert client_seen["answered"]["status"] in ("completed", "incomplete")  # the calls and outputs were read back
    streamed = client_seen["called_stream"]
    assert [i["name"] for i in streamed["response"]["output"] if i["type"] == "function_call"] == \
        [c["name"] for c in calls]
    assert "response.function_call_arguments.done" in streamed["types"]


def test_a_json_schema_format_and_the_token_limit(client_seen):
    assert json.loads(client_seen["structured"]["output_text"])["pick"] in ("left", "right")
    short = client_seen["short"]
    assert (short["status"], short["incomplete_details"], short["usage"]["output_tokens"]) == \
        ("incomplete", {"reason": "max_output_tokens"}, 2)


def test_what_a_stateless_server_cannot_do_is_refused_naming_the_field(served, client_seen):
    assert client_seen["previous"]["status"] == 400 and client_seen["previous"]["param"] == "previous_response_id"
    assert client_seen["image"]["status"] == 400 and client_seen["image"]["param"] == "input[0].content[0]"
    assert client_seen["retrieve"] == 404


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": "a", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "a", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),  # accepted and dropped: no turn is left
    ({"input": [{"role": "critic", "content": "a"}]}, "input[0].role"),
    ({"input": "a", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": "a", "background": True}, "background"),
    ({"input": "a", "metadata": {"k": 5}}, "metadata"),
])
def test_bad_requests_are_400s_naming_the_responses_parameter(served, body, param):
    status, reply = post_json(served.base, "/responses", {"model": MODEL, **body})
    assert (status, reply["error"]["param"]) == (400, param), reply


def test_a_refusal_before_the_stream_starts_has_its_status(served):
    status, reply = post_json(served.base, "/responses", {"model": "no-such-model", "input": "a", "stream": True})
    assert (status, reply["error"]["code"]) == (404, "model_not_found"), reply
