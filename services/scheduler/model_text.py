"""A generator's text side at the scheduler: its tokenizer and chat template, built once per model
version from what its worker declared (docs/ARCHITECTURE.md, "Tokenization").

The scheduler turns text into ids here, once per request, because prefix caching and
cache-aware routing work on ids; the gateway charges quotas from the usage the scheduler reports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common import errors
from services.common.grammar_after_reasoning import GrammarAfterReasoning
from services.common.reasoning_formats import DEEPSEEK_R1, THINK_END, THINK_START
from services.common.tool_call_formats import parser_for_template
from services.scheduler.chat_template import ChatTemplate
from services.scheduler.hf_tokenizer import HFTokenizer, HFTokenizerSource
from services.scheduler.tokenizer import ByteTokenizer, Tokenizer
from services.scheduler.tokenizer_spec import TokenizerKind, TokenizerSpec

# The template of byte-level models that declare none: the one the gateway applied to every model
# before templates came with the models (a `<role>: <content>` line per message, then `assistant:`),
# so the demo models answer chat exactly as they did.
#
#     system: Be brief.
#     user: Hello
#     assistant:
BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message.role }}: {{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass(frozen=True)
class ChatRendering:
    """How a conversation is rendered (vLLM's chat options): the assistant turn's opening added, the
    final message left open instead, extra template variables (chat_template_kwargs)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    variables: Mapping[str, Any] = field(default_factory=dict)
    # The rendered text encoded with the tokenizer's special tokens or not; None: the model's way.
    add_special_tokens: bool | None = None


# Prompt tokens read for a think tag at its end: the tag and the whitespace after it, even where
# each character is a token of its own.
_TAIL_TOKENS = 32


@dataclass(frozen=True)
class ReasoningStart:
    parser: str = ""  # "": nothing to split (no parser, or the prompt closed the block)
    opened: bool = False  # the prompt ends inside a think block
    # Where the output's grammar (structured output) starts: after the think block, as vLLM constrains
    # a reasoning model; None: it holds the whole output from its first token, or there is none.
    grammar_after: GrammarAfterReasoning | None = None


NO_REASONING = ReasoningStart()


@dataclass(frozen=True)
class ModelText:
    tokenizer: Tokenizer
    # None: the model has no chat template (chat is refused; prompts work).
    chat_template: ChatTemplate | None
    # True for byte tokenizers: their special ids have no spelling, so a template cannot write the
    # BOS; the rendered text gets it as a prompt does. HF templates write their own (False).
    chat_adds_special_tokens: bool = False
    # The format the model writes tool calls in (tool_call_formats.py); "": not known.
    tool_call_parser: str = ""
    # How the model sets its reasoning apart (reasoning_formats.py); "": it does not.
    reasoning_parser: str = ""
    # The ids of `<think>` and `</think>` where each is one token of the tokenizer (None: it is not).
    think_start_token_id: int | None = None
    think_end_token_id: int | None = None

    def chat_prompt_ids(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = (),
                        rendering: ChatRendering = ChatRendering()) -> tuple[int, ...]:
        """The template rendered as `rendering` asks (and with `tools`, as apply_chat_template's
        argument) and encoded as apply_chat_template encodes it (HF: the rendered text holds its own
        BOS, so none is added)."""
        if self.chat_template is None:
            raise errors.InvalidArgument("this model has no chat template, so it cannot answer chat; "
                                         "send a prompt (completions) instead of messages")
        rendered = self.chat_template.render(messages, tools=tools,
                                             add_generation_prompt=rendering.add_generation_prompt,
                                             continue_final_message=rendering.continue_final_message,
                                             variables=rendering.variables)
        special = self.chat_adds_special_tokens if rendering.add_special_tokens is None else rendering.add_special_tokens
        return self.tokenizer.encode(rendered, add_special_tokens=special)

    def reasoning_start(self, prompt_ids: Sequence[int], constrained: bool = False) -> ReasoningStart:
        """What a stream of this prompt names on its first chunk: the parser, unless the prompt ends
        with a closed think block (the template turned thinking off: there is nothing to split),
        whether it ends inside an open one (the output begins as reasoning), and, for a `constrained`
        output (a grammar), where its grammar starts. Only the prompt's last tokens are read: a block
        in an earlier turn says nothing about this one (vLLM reads the whole prompt for its last tag)."""
        if not self.reasoning_parser:
            return NO_REASONING
        tail = b"".join(self.tokenizer.token_bytes(i) for i in prompt_ids[-_TAIL_TOKENS:])
        text = tail.decode("utf-8", errors="replace").rstrip()
        if text.endswith(THINK_END):
            return NO_REASONING
        opened = text.endswith(THINK_START)
        return ReasoningStart(self.reasoning_parser, opened, self._grammar_after(opened) if constrained else None)

    def _grammar_after(self, opened: bool) -> GrammarAfterReasoning | None:
        """Where a grammar starts in an output that may begin as reasoning: after `</think>`, found by its
        id, so only where it is one token; for a qwen3 output that the prompt did not open, only if
        the output opens with `<think>`, likewise one token. None (the grammar holds the whole output,
        as before): a tag that the model would write in pieces."""
        if self.think_end_token_id is None:
            return None
        if opened or self.reasoning_parser == DEEPSEEK_R1:
            return GrammarAfterReasoning(self.think_end_token_id)
        if self.think_start_token_id is None:
            return None
        return GrammarAfterReasoning(self.think_end_token_id, self.think_start_token_id)


def build_model_text(spec: TokenizerSpec, tokenizer_json: bytes = b"") -> ModelText:
    """ValueError (TokenizerRefused, ChatTemplateInvalid) naming what cannot serve. HF builds take
    a second or so for a 128k vocabulary: the Attach session runs this off the event loop."""
    special_tokens = dict(spec.special_tokens)
    tokenizer: Tokenizer
    if spec.kind is TokenizerKind.HF:
        tokenizer = HFTokenizer(HFTokenizerSource(
            tokenizer_json=tokenizer_json, vocab_size=spec.vocab_size, eos_token_id=spec.eos_token_id,
            stop_token_ids=spec.stop_token_ids,
            add_bos_token=spec.add_bos_token, add_eos_token=spec.add_eos_token, special_tokens=special_tokens))
    else:
        tokenizer = ByteTokenizer.from_spec(vocab_size=spec.vocab_size, eos_token_id=spec.eos_token_id,
                                            bos_token_id=spec.bos_token_id)
    is_bytes = spec.kind is not TokenizerKind.HF
    source = spec.chat_template or (BYTE_CHAT_TEMPLATE if is_bytes else "")
    template = ChatTemplate(source, special_tokens) if source else None
    return ModelText(tokenizer, template, chat_adds_special_tokens=is_bytes,
                     tool_call_parser=spec.tool_call_parser or parser_for_template(spec.chat_template),
                     reasoning_parser=spec.reasoning_parser,
                     think_start_token_id=_one_token(tokenizer, THINK_START),
                     think_end_token_id=_one_token(tokenizer, THINK_END))


def _one_token(tokenizer: Tokenizer, tag: str) -> int | None:
    """The id of the token whose text is `tag` (an added token of tokenizer.json, as Qwen3's and the R1
    distills' think tags are), or None where the tokenizer writes it in several, or its token carries
    no text (a special token, which a stream never shows)."""
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return ids[0] if len(ids) == 1 and tokenizer.token_bytes(ids[0]) == tag.encode() else None
