"""ChatTemplate renders what transformers' apply_chat_template renders, and fails as a domain error."""

from __future__ import annotations

from datetime import datetime

import pytest
from tokenizers import Tokenizer as RustTokenizer

from services.common import errors
from services.scheduler.chat_template import ChatTemplate, ChatTemplateInvalid, ChatTemplateRefused

from .hf_tokenizer_files import byte_level_json, sentencepiece_json
from .test_hf_tokenizer import byte_level, sentencepiece

FIXED_NOW = datetime(2026, 3, 14, 15, 9, 26)

LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + strftime_now("%d %b %Y") + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

CHATML = """{%- for message in messages %}
    {%- if loop.first and messages[0]['role'] != 'system' %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\\n' }}
    {%- if message.content is string %}{{ message.content }}{%- else %}{{ message.content | tojson }}{%- endif %}
    {%- if message.tool_calls is defined %}
        {%- for call in message.tool_calls %}
<tool_call>
{{ call | tojson }}
</tool_call>
        {%- endfor %}
    {%- endif %}
    {%- if message.reasoning_content is defined %}<think>{{ message.reasoning_content }}</think>{% endif %}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

MISTRAL = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {% generation %}{{- ' ' + message['content'] + eos_token}}{% endgeneration %}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

# Written for these tests in the shape of Qwen3's template: what it asks of the renderer is a
# namespace assigned inside a loop, reversed iteration, string methods (startswith, split, rstrip,
# lstrip), a past turn's reasoning dropped before the last user query, and `enable_thinking`.
QWEN3_STYLE = """{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if message.role == 'user' and message.content is string and not message.content.startswith('<tool_response>') %}
        {%- if ns.last_query == messages|length - 1 %}{%- set ns.last_query = index %}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and reasoning %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "Grüße! Wie geht's? 🙂"}],
    [{"role": "system", "content": "  Answer in Japanese.  "}, {"role": "user", "content": "東京は？"},
     {"role": "assistant", "content": "日本の首都です。"}, {"role": "user", "content": "ありがとう <b>&</b>"}],
    [{"role": "user", "content": "What's the weather?"},
     {"role": "assistant", "content": "", "reasoning": "Call the tool.", "tool_calls": [
         {"type": "function", "function": {"name": "weather", "arguments": {"city": "Köln", "unit": "°C"}}}]},
     {"role": "user", "content": "and tomorrow?", "name": None}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
     {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "<think>\ncheck</think>6, sure"},
     {"role": "user", "content": "<tool_response>x</tool_response>"}],
]

TEMPLATES = {  # name: (template, which tokenizer, its special tokens)
    "llama3": (LLAMA3, "byte_level", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "chatml": (CHATML, "byte_level", {"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>"}),
    "mistral": (MISTRAL, "sentencepiece", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    "qwen3": (QWEN3_STYLE, "byte_level", {"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>"}),
}


@pytest.fixture
def transformers_at_fixed_now(monkeypatch):
    """transformers, its templates' strftime_now reading FIXED_NOW (as ours are given it)."""
    transformers = pytest.importorskip("transformers")
    from transformers.utils import chat_template_utils

    class FixedNow(datetime):
        @classmethod
        def now(cls, tz=None):
            return FIXED_NOW

    monkeypatch.setattr(chat_template_utils, "datetime", FixedNow)
    return transformers


def alternating(conversation) -> bool:
    roles = [m["role"] for m in conversation if m["role"] != "system"]
    return all(role == ("user" if i % 2 == 0 else "assistant") for i, role in enumerate(roles))


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_renders_and_encodes_as_transformers_apply_chat_template(name, conversation, transformers_at_fixed_now):
    transformers = transformers_at_fixed_now
    source, kind, special = TEMPLATES[name]
    js = byte_level_json() if kind == "byte_level" else sentencepiece_json()
    reference = transformers.PreTrainedTokenizerFast(tokenizer_object=RustTokenizer.from_str(js.decode()),
                                                     chat_template=source, **special)
    ours = ChatTemplate(source, special, now=lambda: FIXED_NOW)
    tokenizer = (byte_level if kind == "byte_level" else sentencepiece)(special_tokens=special)
    messages = CONVERSATIONS[conversation]
    if name == "mistral" and not alternating(messages):
        return  # the refusal has its own test
    text = ours.render(messages)
    assert text == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected_ids = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                 return_dict=False)
    assert list(tokenizer.encode(text, add_special_tokens=False)) == list(expected_ids)


def test_a_template_that_raises_is_the_requests_invalid_argument_with_its_message():
    template = ChatTemplate(MISTRAL, {"bos_token": "<s>", "eos_token": "</s>"})
    with pytest.raises(ChatTemplateRefused) as caught:
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert isinstance(caught.value, errors.InvalidArgument)
    assert caught.value.message == ("the model's chat template refused the conversation: After the optional system "
                                    "message, conversation roles must alternate user/assistant/user/assistant/...")
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


@pytest.mark.parametrize("source, message", [
    ("{{ messages[0].content.upper() }}", None),  # a method of str is allowed
    ("{{ messages[5]['content'] }}", "refused the conversation: list object has no element 5"),
    ("{{ messages.__class__.__mro__ }}", "refused the conversation: access to attribute '__class__' .* unsafe"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "refused the conversation: .*unsafe"),
    ("{% set ns = namespace(_x=1) %}", "refused the conversation: .*may not start with '_'"),
    ("{{ messages.append(1) }}", "refused the conversation: .*unsafe"),  # immutable
    ("{{ 1 / 0 }}", "failed on the conversation: ZeroDivisionError"),
])
def test_the_sandbox_holds_and_failures_are_domain_errors(source, message):
    template = ChatTemplate(source, {})
    messages = [{"role": "user", "content": "hi"}]
    if message is None:
        template.render(messages)
    else:
        with pytest.raises(ChatTemplateRefused, match=message):
            template.render(messages)


def test_a_template_that_does_not_compile_is_refused_with_its_line():
    with pytest.raises(ChatTemplateInvalid, match=r"chat template line 2: .*'endfor'"):
        ChatTemplate("{% for m in messages %}\n{{ m }}", {})


def test_strftime_now_reads_the_injected_clock_and_tojson_leaves_html_alone():
    template = ChatTemplate("{{ strftime_now('%Y-%m-%d') }} {{ messages[0] | tojson }}", {}, now=lambda: FIXED_NOW)
    assert template.render([{"role": "user", "content": "<é>"}]) == '2026-03-14 {"role": "user", "content": "<é>"}'


def test_none_fields_are_dropped_and_generation_prompt_is_on_by_default():
    template = ChatTemplate("{% for m in messages %}{{ m | tojson }}{% endfor %}{{ add_generation_prompt }}", {})
    assert template.render([{"role": "user", "content": "x", "name": None}]) == (
        '{"role": "user", "content": "x"}True')


# -- vLLM's chat options: continue_final_message, chat_template_kwargs ---------------------------------

OPEN_ENDINGS = ["Sure, the answer is", "  Spaced out,  ", "日本の"]
THINKING = CHATML.replace("{%- if add_generation_prompt %}",
                          "{%- if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
                          "{%- if add_generation_prompt %}")


def _reference(source: str, special: dict, kind: str = "byte_level"):
    transformers = pytest.importorskip("transformers")
    js = byte_level_json() if kind == "byte_level" else sentencepiece_json()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=RustTokenizer.from_str(js.decode()),
                                                chat_template=source, **special)


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("ending", OPEN_ENDINGS)
def test_continue_final_message_leaves_the_last_turn_open_as_transformers_does(name, ending, transformers_at_fixed_now):
    source, kind, special = TEMPLATES[name]
    messages = [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": ending}]
    ours = ChatTemplate(source, special, now=lambda: FIXED_NOW).render(messages, add_generation_prompt=False,
                                                                        continue_final_message=True)
    expected = _reference(source, special, kind).apply_chat_template(messages, tokenize=False,
                                                                     add_generation_prompt=False,
                                                                     continue_final_message=True)
    assert ours == expected and ours.rstrip().endswith(ending.strip())


def test_template_variables_reach_the_template_as_transformers_passes_them():
    special = TEMPLATES["chatml"][2]
    messages = [{"role": "user", "content": "Hi"}]
    template = ChatTemplate(THINKING, special)
    reference = _reference(THINKING, special)
    for variables in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        assert template.render(messages, variables=variables) == \
            reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **variables)
    assert "<think></think>" in template.render(messages, variables={"enable_thinking": False})
    # A variable may stand in for a special token's name, as in transformers.
    assert "<|end|>" in ChatTemplate("{{ eos_token }}", special).render(messages, variables={"eos_token": "<|end|>"})


def test_continue_final_message_is_refused_when_the_template_drops_the_final_message():
    drops_assistant = "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}"
    with pytest.raises(ChatTemplateRefused, match="continue_final_message: the final message's content does not"):
        ChatTemplate(drops_assistant, {}).render([{"role": "user", "content": "a"},
                                                  {"role": "assistant", "content": "zzz"}],
                                                 add_generation_prompt=False, continue_final_message=True)


def test_the_qwen3_style_template_drops_reasoning_before_the_last_query_and_keeps_it_after():
    source, _, special = TEMPLATES["qwen3"]
    text = ChatTemplate(source, special).render(CONVERSATIONS[3], variables={"enable_thinking": False})
    # The first turn's reasoning precedes the last real user query (a tool response is not one): dropped.
    assert "<|im_start|>assistant\n4<|im_end|>" in text and "add them" not in text
    assert "<|im_start|>assistant\n<think>\ncheck\n</think>\n\n6, sure<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
