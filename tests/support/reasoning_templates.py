"""A chat template of a reasoning model (tests only), shortened from the shape of Qwen3's: tools in
the Hermes format (tool_templates.HERMES), and the generation prompt's think block as the template
variables ask:
`enable_thinking: false` writes an empty, closed one (Qwen3's switch), `thinking_in_prompt: true`
opens one the model continues (the way Qwen3-Thinking-2507, QwQ and the R1 distills always do).
"""

from __future__ import annotations

from tests.support.tool_templates import HERMES

_GENERATION_PROMPT = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
assert HERMES.endswith(_GENERATION_PROMPT)

QWEN3 = HERMES[:-len(_GENERATION_PROMPT)] + """{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}
{%- elif thinking_in_prompt is defined and thinking_in_prompt %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}
"""
