"""Tool calls through the whole mesh (issue 39), on a tiny Qwen2 checkpoint made here whose chat
template offers tools in the Hermes format: multi-turn conversations (a question, the model's
calls, a `tool` turn answering each, the final answer) round-trip through the stock `openai`
client's types, streamed and not. tool_choice required and a named function constrain the
output, so even this random model always makes valid calls; the scheduler renders tools, calls
and results through the template as transformers' apply_chat_template does. gRPC callers get the
tools rendered and the format named on the first chunk.

A third tools model's template asks for Qwen3-Coder's XML calls: the scheduler tells qwen3_coder
from it, and the front types each parameter's text by the request's tool schemas.

The same mesh serves a reasoning model (a Qwen3-shaped template, so the importer records qwen3):
a regex holds it to `<think>...</think>answer`, or its template opens the block in the prompt, and
chat, Responses and gRPC callers see the reasoning split off the real streamed output. Its tokenizer
writes the think tags in pieces, so a grammar holds its whole output; a twin whose tokenizer has them
as single tokens (as Qwen3's) thinks freely first, and only its answer is held to a JSON schema.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import tokenizers
import transformers

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common.tool_call_formats import HERMES, LLAMA3_JSON, QWEN3_CODER
from tests.support import reasoning_templates, tool_templates
from tests.support.hf_checkpoints import save_model_directory
from tests.support.hf_mesh import serving_checkpoints
from tests.support.https_json import post_json, post_stream
from tests.support.side_venv import side_venv_python
from tests.unit.scheduler.hf_tokenizer_files import byte_level_json, num_ids
from tools.testbed import session_tls

pytestmark = pytest.mark.integration

MODEL = "tiny-tools"
THINK = "tiny-think"
THINK_TAGS = "tiny-think-tags"  # THINK with <think> and </think> one token each, as in Qwen3's tokenizer
LLAMA = "tiny-tools-llama"
CODER = "tiny-tools-coder"  # a Qwen3-Coder-shaped template: qwen3_coder, told from it
SIDE_VENV = ("openai", "openai==3.51.0")  # the venv of tests/openai/test_openai_client.py, built once
SCRIPT = Path(__file__).with_name("openai_tools_script.py")
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The forecast for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock", "description": "The time now",
                                           "parameters": {"type": "object", "properties": {},
                                                          "additionalProperties": False}}}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
# Auto through the mesh: a regex holds the random model to a Hermes call, so the parser has one to read.
FORCED_CALL = r'<tool_call>\{"name": "weather", "arguments": \{"city": "(Oslo|Rome)", "days": [1-7]\}\}</tool_call>'
# The same call in Qwen3-Coder's XML: every value is text, typed by the schema (days: an integer).
FORCED_XML_CALL = (r"Checking\.\n<tool_call>\n<function=weather>\n<parameter=city>\n(Oslo|Rome)\n</parameter>\n"
                   r"<parameter=days>\n[1-7]\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai-tools")
    # The tools' signatures make prompts of ~700 byte-level tokens: a longer context than the tiny default.
    save_model_directory(tmp / MODEL, "qwen2", seed=7, chat_template=tool_templates.HERMES,
                         max_position_embeddings=2048)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp / MODEL)
    # A template that does not tell the format (no tools section): the manifest names it.
    save_model_directory(tmp / LLAMA, "llama3", seed=8)
    save_model_directory(tmp / CODER, "qwen2", seed=6, chat_template=tool_templates.QWEN3_CODER,
                         max_position_embeddings=2048)
    # A reasoning model's template (Qwen3's shape): the importer tells qwen3 from it.
    save_model_directory(tmp / THINK, "qwen2", seed=5, chat_template=reasoning_templates.QWEN3,
                         max_position_embeddings=2048)
    save_model_directory(tmp / THINK_TAGS, "qwen2", seed=5, chat_template=reasoning_templates.QWEN3,
                         added_tokens=("<think>", "</think>"), max_position_embeddings=2048)
    with serving_checkpoints(tmp, [MODEL, LLAMA, CODER, THINK, THINK_TAGS], kv_cache_bytes=1 << 22,
                             options={LLAMA: {"tool_call_parser": LLAMA3_JSON}}) as mesh:
        yield mesh, tokenizer


@pytest.fixture(scope="module")
def conversations(served):
    mesh, _ = served
    python = side_venv_python(*SIDE_VENV)
    done = subprocess.run([str(python), str(SCRIPT), mesh.base, str(session_tls.session_pki().ca_path), MODEL,
                           json.dumps(TOOLS)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr + mesh.mesh.logs()
    return json.loads(done.stdout)


def template_messages(messages: list[dict]) -> list[dict]:
    """The conversation as a transformers user passes it: each call's arguments parsed."""
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [{**c, "function": {**c["function"],
                                                        "arguments": json.loads(c["function"]["arguments"])}}
                                     for c in message["tool_calls"]]
        out.append(message)
    return out


@pytest.mark.parametrize("name", ["named", "named_stream", "required", "required_stream"])
def test_a_constrained_tool_conversation_round_trips_through_the_clients_types(served, conversations, name):
    _, tokenizer = served
    seen = conversations[name]
    question, assistant, *results = seen["messages"]
    assert seen["finish_reason"] == "tool_calls"
    calls = assistant["tool_calls"]
    assert len(calls) == 1 and assistant.get("content") is None  # parallel_tool_calls false: exactly one
    call = calls[0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    if name.startswith("named"):
        assert call["function"]["name"] == "weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    assert [r["tool_call_id"] for r in results] == [call["id"]]
    final = seen["final"]
    assert isinstance(final["content"], str) and final["tool_calls"] is None
    assert final["finish_reason"] in ("stop", "length")
    # The scheduler rendered the tools, the call and its result as transformers does.
    expected = tokenizer.apply_chat_template(template_messages(seen["messages"]), tools=TOOLS,
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
    assert final["prompt_tokens"] == len(expected)


def test_streamed_and_whole_replies_make_the_same_seeded_call(conversations):
    for name in ("named", "required"):
        whole, streamed = conversations[name]["messages"][1], conversations[f"{name}_stream"]["messages"][1]
        assert [c["function"] for c in whole["tool_calls"]] == [c["function"] for c in streamed["tool_calls"]]


def test_auto_lets_the_model_answer_and_reads_any_call_it_makes(conversations):
    auto = conversations["auto"]
    # A random model seldom writes a whole <tool_call> element: its text is content (the parsers'
    # own tests read fixed texts); what it calls, if anything, is a call of an offered tool.
    assert isinstance(auto["content"], str) or auto["tool_calls"]
    assert all(c["function"]["name"] in SCHEMAS for c in auto["tool_calls"])
    assert auto["finish_reason"] in ("stop", "length", "tool_calls")


def grpc_generate(served, messages: list[dict], **fields) -> list[gateway_pb2.GenerateResponse]:
    request = gateway_pb2.GenerateRequest(
        model=common_pb2.ModelRef(name=MODEL), messages=[gateway_pb2.ChatMessage(**m) for m in messages],
        tools=[gateway_pb2.Tool(name=t["function"]["name"], description=t["function"]["description"],
                                parameters=json.dumps(t["function"]["parameters"])) for t in TOOLS], **fields)
    with session_tls.channel(served[0].mesh.gateway.address) as channel:
        return list(gateway_pb2_grpc.InferenceStub(channel).Generate(request, timeout=60))


def test_grpc_callers_get_the_tools_rendered_and_the_format_named(served):
    messages = [{"role": "user", "content": "Time?"}]
    chunks = grpc_generate(served, messages, sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0,
                                                                                ignore_eos=True))
    assert chunks[0].tool_call_parser == HERMES
    expected = served[1].apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    assert chunks[-1].usage.prompt_tokens == len(expected)


@pytest.mark.parametrize(("tool_choice", "structured"), [
    ("weather", None),  # constrained to the arguments: the text is them
    ("", common_pb2.StructuredOutput(regex=FORCED_CALL)),  # auto: the model's own format, parsed
])
def test_grpc_callers_get_the_calls_parsed_on_the_last_chunk(served, tool_choice, structured):
    sampling = common_pb2.SamplingParams(max_tokens=120, temperature=1.0, seed=9, structured=structured)
    chunks = grpc_generate(served, [{"role": "user", "content": "Weather?"}], tool_choice=tool_choice,
                           sampling=sampling, n=2)
    for index in (0, 1):
        mine = [c for c in chunks if c.choice_index == index]
        calls, text = mine[-1].tool_calls, "".join(c.text for c in mine)
        assert [c.name for c in calls] == ["weather"] and calls[0].id.startswith("call_")
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
        assert text == calls[0].arguments if tool_choice else text.startswith("<tool_call>")
        assert all(not c.tool_calls for c in mine[:-1])


def test_grpc_tool_choice_naming_no_tool_is_invalid_argument(served):
    import grpc

    with pytest.raises(grpc.RpcError) as caught:
        grpc_generate(served, [{"role": "user", "content": "a"}], tool_choice="nope")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "tool_choice names 'nope', which is not among the tools (weather, clock)"


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tools": "weather"}, "tools", "tools must be a list"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                             "properties": {"a": {"type": "nope"}}}}}],
      "tool_choice": "required"}, "tools", "sampling.structured: invalid json_schema"),
])
def test_bad_tools_are_400s_naming_the_field(served, body, param, fragment):
    status, reply = post_json(served[0].base, "/chat/completions",
                              {"model": MODEL, "messages": [{"role": "user", "content": "a"}], **body})
    assert (status, reply["error"]["param"]) == (400, param), reply
    assert fragment in reply["error"]["message"]



def auto_chat(served, body: dict) -> tuple[str, str, list[dict]]:
    """(content, finish_reason, the calls' functions) of a chat reply, streamed (body's "stream") or
    not; a stream's calls must each come whole in one delta, numbered from 0."""
    if body["stream"]:
        status, events = post_stream(served[0].base, "/chat/completions", body)
        assert status == 200
        deltas = [e["choices"][0]["delta"] for e in events[:-1]]
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert [c["index"] for c in calls] == list(range(len(calls))) and all(c["id"].startswith("call_") for c in calls)
        content = "".join(d.get("content") or "" for d in deltas)
        return content, events[-2]["choices"][0]["finish_reason"], [c["function"] for c in calls]
    status, reply = post_json(served[0].base, "/chat/completions", body)
    assert status == 200, reply
    message = reply["choices"][0]["message"]
    calls = [c["function"] for c in message.get("tool_calls") or []]
    return message["content"] or "", reply["choices"][0]["finish_reason"], calls


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_the_models_own_call_format_streamed_and_not(served, stream):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "max_tokens": 120,
            "temperature": 1.0, "seed": 9, "guided_regex": FORCED_CALL, "stream": stream}
    content, finish_reason, calls = auto_chat(served, body)
    assert (content, finish_reason, [c["name"] for c in calls]) == ("", "tool_calls", ["weather"])
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)


@pytest.mark.parametrize("stream", [False, True])
def test_qwen3_coder_calls_are_told_from_the_template_and_typed_by_the_tools_schemas(served, stream):
    body = {"model": CODER, "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "max_tokens": 160,
            "temperature": 1.0, "seed": 9, "guided_regex": FORCED_XML_CALL, "stream": stream}
    content, finish_reason, calls = auto_chat(served, body)
    assert (content, finish_reason, [c["name"] for c in calls]) == ("Checking.\n", "tool_calls", ["weather"])
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)  # "days" an integer, as the schema says


def test_grpc_callers_are_told_a_templates_qwen3_coder_format(served):
    request = gateway_pb2.GenerateRequest(
        model=common_pb2.ModelRef(name=CODER), messages=[gateway_pb2.ChatMessage(role="user", content="Weather?")],
        tools=[gateway_pb2.Tool(name="weather", parameters=json.dumps(WEATHER))],
        sampling=common_pb2.SamplingParams(max_tokens=160, temperature=1.0, seed=9,
                                           structured=common_pb2.StructuredOutput(regex=FORCED_XML_CALL)))
    with session_tls.channel(served[0].mesh.gateway.address) as channel:
        chunks = list(gateway_pb2_grpc.InferenceStub(channel).Generate(request, timeout=60))
    assert chunks[0].tool_call_parser == QWEN3_CODER
    (call,) = chunks[-1].tool_calls
    assert call.name == "weather" and isinstance(json.loads(call.arguments)["days"], int)


@pytest.mark.parametrize("stream", [False, True])
def test_a_manifests_parser_reads_llama3_json_calls(served, stream):
    forced = r'\{"name": "clock", "parameters": \{\}\}'
    body = {"model": LLAMA, "messages": [{"role": "user", "content": "Time?"}], "tools": TOOLS, "max_tokens": 60,
            "temperature": 1.0, "seed": 2, "guided_regex": forced, "stream": stream}
    if stream:
        status, events = post_stream(served[0].base, "/chat/completions", body)
        calls = [c for e in events[:-1] for c in e["choices"][0]["delta"].get("tool_calls", [])]
        finish_reason = events[-2]["choices"][0]["finish_reason"]
    else:
        status, reply = post_json(served[0].base, "/chat/completions", body)
        calls, finish_reason = reply["choices"][0]["message"]["tool_calls"], reply["choices"][0]["finish_reason"]
    assert status == 200
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("clock", "{}")]
    assert finish_reason == "tool_calls"


# Reasoning through the mesh: a regex holds the random model to a think block, then an answer.
FORCED_THOUGHT = r"<think>[a-z]{2,6}( [a-z]{2,6}){1,3}</think>[a-z]{2,6}( [a-z]{2,6}){1,3}"
THOUGHT = re.compile(r"[a-z]{2,6}( [a-z]{2,6}){1,3}")


def think_chat(served, stream: bool, **body) -> tuple[str | None, str | None, str]:
    """(reasoning_content, content, finish_reason) of a chat reply of the reasoning model, streamed or
    not; a stream's reasoning and content are its deltas' joined, and both names agree."""
    body = {"model": THINK, "messages": [{"role": "user", "content": "Why?"}], "temperature": 1.0, "seed": 4,
            "max_tokens": 40, "stream": stream, **body}
    if not stream:
        status, reply = post_json(served[0].base, "/chat/completions", body)
        assert status == 200, reply
        message = reply["choices"][0]["message"]
        assert message["reasoning"] == message["reasoning_content"]
        return message["reasoning_content"], message["content"], reply["choices"][0]["finish_reason"]
    status, events = post_stream(served[0].base, "/chat/completions", body)
    assert status == 200
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    if "guided_regex" in body:  # no "<" but the tags': no piece of one was passed on
        assert all("<" not in (d.get("reasoning_content") or "") + (d.get("content") or "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    return reasoning or None, content or None, events[-2]["choices"][0]["finish_reason"]


def test_a_reasoning_models_think_block_is_split_off_streamed_and_not(served):
    whole = think_chat(served, False, guided_regex=FORCED_THOUGHT)
    streamed = think_chat(served, True, guided_regex=FORCED_THOUGHT)
    assert whole == streamed  # the same seeded output, split the same way whatever its chunks
    reasoning, content, finish_reason = whole
    assert THOUGHT.fullmatch(reasoning) and re.fullmatch(r"[a-z][a-z ]*", content), whole
    assert finish_reason in ("stop", "length")  # the answer may be cut by max_tokens


def test_tool_calls_are_read_after_the_reasoning(served):
    forced = r'<think>[a-z]{2,6} [a-z]{2,6}</think><tool_call>\{"name": "clock", "arguments": \{\}\}</tool_call>'
    body = {"model": THINK, "messages": [{"role": "user", "content": "Time?"}], "tools": TOOLS, "max_tokens": 80,
            "temperature": 1.0, "seed": 3, "guided_regex": forced}
    status, reply = post_json(served[0].base, "/chat/completions", body)
    assert status == 200, reply
    message = reply["choices"][0]["message"]
    assert re.fullmatch(r"[a-z]{2,6} [a-z]{2,6}", message["reasoning_content"])
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["clock"]
    assert reply["choices"][0]["finish_reason"] == "tool_calls"


def test_a_block_the_prompt_opens_makes_the_whole_free_output_reasoning(served):
    opened = {"chat_template_kwargs": {"thinking_in_prompt": True}, "max_tokens": 6, "min_tokens": 6}
    for stream in (False, True):
        reasoning, content, finish_reason = think_chat(served, stream, **opened)
        # A random model never writes </think> in 6 tokens here: a reply cut mid-thought is all reasoning.
        assert (bool(reasoning), content, finish_reason) == (True, None, "length")


def test_thinking_turned_off_in_the_template_leaves_the_output_unsplit(served):
    off = {"chat_template_kwargs": {"enable_thinking": False}, "guided_regex": FORCED_THOUGHT}
    reasoning, content, _ = think_chat(served, False, **off)
    assert reasoning is None and content.startswith("<think>")


def test_responses_put_the_reasoning_item_before_the_message_streamed_and_not(served):
    body = {"model": THINK, "input": "Why?", "max_output_tokens": 6, "min_tokens": 6, "temperature": 1.0,
            "seed": 4, "chat_template_kwargs": {"thinking_in_prompt": True}}
    status, reply = post_json(served[0].base, "/responses", body)
    assert status == 200, reply
    assert [item["type"] for item in reply["output"]] == ["reasoning", "message"]
    thought = reply["output"][0]["content"][0]["text"]
    assert thought and reply["output"][1]["content"][0]["text"] == ""
    status, events = post_stream(served[0].base, "/responses", {**body, "stream": True})
    assert status == 200
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    (done,) = [e for e in events if e["type"] == "response.reasoning_text.done"]
    assert "".join(deltas) == done["text"] == thought  # the same seeded output
    assert [item["type"] for item in events[-1]["response"]["output"]] == ["reasoning", "message"]


@pytest.mark.parametrize(("kwargs", "parser", "opened"), [
    ("", "qwen3", False), ('{"thinking_in_prompt": true}', "qwen3", True), ('{"enable_thinking": false}', "", False),
])
def test_grpc_callers_get_the_text_as_written_and_the_reasoning_parser_named(served, kwargs, parser, opened):
    request = gateway_pb2.GenerateRequest(
        model=common_pb2.ModelRef(name=THINK), messages=[gateway_pb2.ChatMessage(role="user", content="Why?")],
        chat_template_kwargs=kwargs,
        sampling=common_pb2.SamplingParams(max_tokens=30, temperature=1.0, seed=4, structured=common_pb2.StructuredOutput(
            regex=FORCED_THOUGHT)))
    with session_tls.channel(served[0].mesh.gateway.address) as channel:
        chunks = list(gateway_pb2_grpc.InferenceStub(channel).Generate(request, timeout=60))
    assert (chunks[0].reasoning_parser, chunks[0].reasoning_opened) == (parser, opened)
    assert not chunks[0].grammar_after_reasoning  # "</think>" is not one token here: the grammar held it all
    text = "".join(c.text for c in chunks)
    assert re.match(r"<think>[a-z ]+</think>[a-z]", text), text  # tags and all: the client splits


ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 22, 333]}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.mark.parametrize("kwargs", [{"thinking_in_prompt": True}, {}])  # the prompt opens the block, or the model
def test_a_json_answer_follows_a_thought_its_grammar_left_free(served, kwargs):
    """vLLM's way: the grammar holds what follows </think> only. The biases push "Q" and the think
    tags, none of which the schema allows anywhere: they make the thought (which the model, on a
    prompt that opened no block, may open at its first token beside the grammar's), </think> ends
    it, and the answer is JSON anyway."""
    vocabulary = tokenizers.Tokenizer.from_str(byte_level_json().decode())
    think, end_think = num_ids(byte_level_json()), num_ids(byte_level_json()) + 1  # the tags, added after it
    bias = {str(vocabulary.token_to_id("Q")): 14, str(think): 12, str(end_think): 11}
    body = {"model": THINK_TAGS, "messages": [{"role": "user", "content": "Ok?"}], "temperature": 1.0, "seed": 4,
            "max_tokens": 120, "logit_bias": bias, "chat_template_kwargs": kwargs,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}}
    status, reply = post_json(served[0].base, "/chat/completions", body)
    assert status == 200, reply
    message = reply["choices"][0]["message"]
    assert re.fullmatch("(Q|<think>)+", message["reasoning_content"] or ""), reply  # the grammar never allows these
    jsonschema.validate(json.loads(message["content"]), ANSWER)
    assert reply["choices"][0]["finish_reason"] == "stop"
