"""Tools and tool turns through a model's chat template: a GenerateRequest's tools and calls render
as transformers' apply_chat_template renders OpenAI's messages with `tools=` (a call's arguments
parsed, as vLLM passes them), and the tool-call format is told from the template or the manifest."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as RustTokenizer

from infermesh.v1 import common_pb2, gateway_pb2
from services.common.tool_call_formats import (
    GRANITE,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    PYTHONIC,
    QWEN3_CODER,
    parser_for_template,
)
from services.scheduler.call_codec import chat_turn, prompt_token_ids, template_tool
from services.scheduler.model_text import build_model_text
from services.scheduler.tokenizer_spec import TokenizerKind, TokenizerSpec
from tests.support import tool_templates

from .hf_tokenizer_files import byte_level_json, num_ids
from .test_chat_template import CHATML, LLAMA3

SPECIAL = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
           "required": ["city"]}
TOOLS = [gateway_pb2.Tool(name="weather", description="Today's weather in a city", parameters=json.dumps(WEATHER)),
         gateway_pb2.Tool(name="clock")]
CONVERSATION = [
    gateway_pb2.ChatMessage(role="system", content="Be brief."),
    gateway_pb2.ChatMessage(role="user", content="Weather in Köln?"),
    gateway_pb2.ChatMessage(role="assistant", content="", tool_calls=[
        gateway_pb2.ToolCall(id="call_1", name="weather", arguments='{"city": "Köln", "unit": "C"}')]),
    gateway_pb2.ChatMessage(role="tool", content='{"temperature": 21}', tool_call_id="call_1", name="weather"),
    gateway_pb2.ChatMessage(role="user", content="And the time?"),
]
# What a client of transformers passes for the same conversation (arguments as a dict, as vLLM does).
OPENAI_MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Köln?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather",
                                                          "arguments": {"city": "Köln", "unit": "C"}}}]},
    {"role": "tool", "content": '{"temperature": 21}', "tool_call_id": "call_1", "name": "weather"},
    {"role": "user", "content": "And the time?"},
]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Today's weather in a city",
                                                  "parameters": WEATHER}},
                {"type": "function", "function": {"name": "clock", "description": ""}}]


# The lines of later families' templates that say how the model calls (shortened, not downloaded).
# Mistral Small 3.2 / Magistral / Devstral (tokenizer v11+): a call is [TOOL_CALLS]name[ARGS]{...}.
MISTRAL_V11 = """{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools and loop.last %}{{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{{- '[INST]' + message.content + '[/INST]' }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{%- for call in message.tool_calls %}
{{- '[TOOL_CALLS]' + call.function.name + '[ARGS]' + call.function.arguments | tojson }}
{%- endfor %}
{{- eos_token }}
{%- elif message.role == 'tool' %}{{- '[TOOL_RESULTS]' + message.content + '[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}"""
# Llama 3.2's pythonic template (vLLM's examples): the tools in the system turn, results under ipython.
LLAMA32_PYTHONIC = """{{- bos_token + '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools is not none %}
{{- 'Environment: ipython\\nYou have access to the following functions. To call functions, please respond with a '
    'python list of the calls. Respond in the format [func_name1(params_name1=params_value1, '
    'params_name2=params_value2...), func_name2(params)] Do not use variables.\\n\\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) + '\\n\\n' }}{%- endfor %}
{%- endif %}
{{- '<|eot_id|>' }}
{%- for message in messages %}
{%- if message.role == 'tool' %}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content }}
{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content }}{%- endif %}
{{- '<|eot_id|>' }}
{%- endfor %}"""
# Llama 4's pythonic template: the calls between <|python_start|> and <|python_end|>.
LLAMA4_PYTHONIC = """{%- if tools %}
{{- '<|header_start|>system<|header_end|>\\n\\nIf you decide to invoke any of the function(s), you MUST put it '
    'in the format of [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]'
    '\\nYou SHOULD NOT include any other text in the response.\\n\\n' + tools | tojson + '<|eot|>' }}
{%- endif %}
{%- for message in messages %}
{%- if message.tool_calls %}{{- '<|header_start|>assistant<|header_end|>\\n\\n<|python_start|>[' }}
{%- for call in message.tool_calls %}{{- call.function.name + '(...)' }}{%- endfor %}
{{- ']<|python_end|><|eot|>' }}
{%- else %}{{- '<|header_start|>' + message.role + '<|header_end|>\\n\\n' + message.content + '<|eot|>' }}{%- endif %}
{%- endfor %}"""
# Llama 3.1's custom tool prompt: <function=name>{...}</function> and ipython, but no <parameter=.
LLAMA31_CUSTOM_FUNCTION = """{%- if tools %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\nTo call a function, reply '
    '<function=example_function_name>{"example_name": "example_value"}</function>\\n' + tools | tojson }}
{%- endif %}"""


def model_text(template: str, tool_call_parser: str = ""):
    return build_model_text(TokenizerSpec(vocab_size=num_ids(byte_level_json()), eos_token_id=4, bos_token_id=-1,
                                          kind=TokenizerKind.HF, special_tokens=tuple(sorted(SPECIAL.items())),
                                          chat_template=template, tool_call_parser=tool_call_parser),
                            byte_level_json())


def test_messages_and_tools_reach_the_template_in_openais_shape():
    assert [chat_turn(m) for m in CONVERSATION] == OPENAI_MESSAGES
    assert [template_tool(t) for t in TOOLS] == OPENAI_TOOLS


@pytest.mark.parametrize("template", [tool_templates.HERMES, tool_templates.LLAMA3_JSON, tool_templates.QWEN3_CODER])
def test_tools_and_tool_turns_render_as_transformers_apply_chat_template(template):
    transformers = pytest.importorskip("transformers")
    reference = transformers.PreTrainedTokenizerFast(tokenizer_object=RustTokenizer.from_str(byte_level_json().decode()),
                                                     chat_template=template, **SPECIAL)
    request = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name="m"), messages=CONVERSATION, tools=TOOLS)
    ids = prompt_token_ids(request, model_text(template))
    expected = reference.apply_chat_template(OPENAI_MESSAGES, tools=OPENAI_TOOLS, add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    assert list(ids) == list(expected)
    text = reference.apply_chat_template(OPENAI_MESSAGES, tools=OPENAI_TOOLS, add_generation_prompt=True,
                                         tokenize=False)
    assert "Köln" in text and "Today's weather in a city" in text  # (qwen3_coder's calls write strings unquoted)


def test_without_tools_the_template_sees_none():
    text = model_text(tool_templates.HERMES).chat_template.render([{"role": "user", "content": "hi"}])
    assert "<tools>" not in text and text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(("template", "parser"), [
    (tool_templates.HERMES, HERMES),
    (tool_templates.LLAMA3_JSON, LLAMA3_JSON),
    # Granite 3's and Mistral v0.3's templates, reduced to the lines that say how the model calls.
    ("{% if tools %}<|start_of_role|>available_tools<|end_of_role|>{{ tools | tojson }}{% endif %}"
     "{% for m in messages %}{% if m.tool_calls %}<|tool_call|>{{ m.tool_calls | tojson }}{% endif %}{% endfor %}",
     GRANITE),
    ("{% for m in messages %}{% if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
     "{% endif %}[INST]{{ m.content }}[/INST]{% endfor %}", MISTRAL),
    (MISTRAL_V11, MISTRAL),
    (tool_templates.QWEN3_CODER, QWEN3_CODER),
    (LLAMA32_PYTHONIC, PYTHONIC),
    (LLAMA4_PYTHONIC, PYTHONIC),
    (LLAMA31_CUSTOM_FUNCTION, LLAMA3_JSON),  # <function=...> alone is not qwen3_coder's
    (CHATML, ""),  # no tools section: nothing to tell
    (LLAMA3, ""),
])
def test_the_tool_call_format_is_told_from_the_template(template, parser):
    assert parser_for_template(template) == parser
    assert model_text(template).tool_call_parser == parser


@pytest.mark.parametrize("parser", [LLAMA3_JSON, PYTHONIC, QWEN3_CODER])
def test_the_manifests_tool_call_parser_overrides_the_template(parser):
    assert model_text(tool_templates.HERMES, parser).tool_call_parser == parser
