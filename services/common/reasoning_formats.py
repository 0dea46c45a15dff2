"""How reasoning models set their chain of thought apart, by the name of the parser that reads it
(vLLM's names).

One home for the names: the manifest may name one (tokenizer.reasoning_parser; `infermesh models
import` tells it from the chat template), the scheduler names it on a stream's first chunk with
what the prompt left open, and the OpenAI front splits each choice's text with it
(gateway/fronts/reasoning.py).
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"

# Qwen3, QwQ: the model may write <think> itself (older templates) or the template opens it in
# the prompt (Qwen3-Thinking-2507, QwQ); an output that neither opens nor continues a block is content.
QWEN3 = "qwen3"
# DeepSeek-R1 and its distills: everything before </think> is reasoning, <think> written or not.
DEEPSEEK_R1 = "deepseek_r1"
REASONING_PARSERS = (QWEN3, DEEPSEEK_R1)
# What `infermesh models import --reasoning-parser` takes to record none, even for a template that
# mentions think blocks.
NO_REASONING_PARSER = "none"


def reasoning_parser_for_template(template: str) -> str:
    """The parser a chat template implies: qwen3 for one that writes think blocks (both tags appear
    in it: Qwen3, QwQ and the DeepSeek-R1 distills all do), "" otherwise. qwen3 reads the R1 distills
    too, because their templates open the block in the prompt, which the scheduler reports."""
    return QWEN3 if THINK_START in template and THINK_END in template else ""
