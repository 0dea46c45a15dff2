"""The formats models write tool calls in, by the name of the parser that reads each (vLLM's names).

One home for the names: the manifest may name one (tokenizer.tool_call_parser), the scheduler
picks one per model and names it on a stream's first chunk, and the OpenAI front parses with it.
"""

from __future__ import annotations

# <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one element per call: Hermes, Qwen2/2.5/3.
HERMES = "hermes"
# {"name": ..., "parameters": {...}} as the whole reply, after <|python_tag|> or not: Llama 3.1+.
LLAMA3_JSON = "llama3_json"
# [{"name": ..., "arguments": {...}}, ...] as the whole reply, after <|tool_call|> or not: Granite 3.
GRANITE = "granite"
# After [TOOL_CALLS] (a special token the detokenizer drops): [{"name": ..., "arguments": {...}}, ...]
# from Mistral's tokenizer v3 models (Mistral 7B v0.3, Mistral-Nemo), or name[ARGS]{...} per call
# from v11+ (Mistral Small 3.1/3.2, Magistral, Devstral; [ARGS] is special too).
MISTRAL = "mistral"
# <tool_call><function=NAME><parameter=P>text</parameter>...</function></tool_call> per call, the
# parameters' text typed by the request's tool schemas: Qwen3-Coder.
QWEN3_CODER = "qwen3_coder"
# [name(p=literal, ...), ...] as the whole reply, a Python list of calls: Llama 3.2 and Llama 4 with
# their pythonic templates, ToolACE.
PYTHONIC = "pythonic"
TOOL_CALL_PARSERS = (HERMES, LLAMA3_JSON, GRANITE, MISTRAL, QWEN3_CODER, PYTHONIC)

# What each family's template writes when it tells the model how to call: a parser is told by any
# one of its marks, and a mark of several parts needs them all. Checked in this order: qwen3_coder's
# template also writes hermes's <tool_call>, pythonic's templates llama3_json's ipython, and
# llama3_json's marks are the least particular.
_TEMPLATE_MARKS: tuple[tuple[str, tuple[tuple[str, ...], ...]], ...] = (
    (QWEN3_CODER, (("<tool_call>", "<function=", "<parameter="),)),
    (HERMES, (("<tool_call>",),)),
    (GRANITE, (("<|tool_call|>",),)),
    (MISTRAL, (("[TOOL_CALLS]",), ("[AVAILABLE_TOOLS]",))),
    (PYTHONIC, (("[func_name1(",),)),
    (LLAMA3_JSON, (("<|python_tag|>",), ("ipython",), ('"parameters"',))),
)


def parser_for_template(template: str) -> str:
    """The parser a chat template's own instructions imply; "" when it names no format (or has no
    tools section at all)."""
    if "tools" not in template:
        return ""
    for parser, marks in _TEMPLATE_MARKS:
        if any(all(part in template for part in mark) for mark in marks):
            return parser
    return ""
