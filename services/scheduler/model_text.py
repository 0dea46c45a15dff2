"""A generator's text side at the scheduler: its tokenizer and chat template, built once per model
version from what its worker declared (docs/ARCHITECTURE.md, "Tokenization").

The scheduler turns text into ids here, once per request, because prefix caching and
cache-aware routing work on ids; the gateway charges quotas from the usage the scheduler reports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.common import errors
from services.scheduler.attach_types import TokenizerKind, TokenizerSpec
from services.scheduler.chat_template import ChatTemplate
from services.scheduler.hf_tokenizer import HFTokenizer, HFTokenizerSource
from services.scheduler.tokenizer import ByteTokenizer, Tokenizer


@dataclass(frozen=True)
class ModelText:
    tokenizer: Tokenizer
    # None: the model has no chat template (chat is refused; prompts work).
    chat_template: ChatTemplate | None

    def chat_prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> tuple[int, ...]:
        """The template rendered with add_generation_prompt and encoded as apply_chat_template
        encodes it (the rendered text holds its own BOS, so none is added)."""
        if self.chat_template is None:
            raise errors.InvalidArgument("this model has no chat template; send a prompt instead of messages")
        return self.tokenizer.encode(self.chat_template.render(messages), add_special_tokens=False)


def build_model_text(spec: TokenizerSpec, tokenizer_json: bytes = b"") -> ModelText:
    """ValueError (TokenizerRefused, ChatTemplateInvalid) naming what cannot serve. HF builds take
    a second or so for a 128k vocabulary: the Attach session runs this off the event loop."""
    special_tokens = dict(spec.special_tokens)
    tokenizer: Tokenizer
    if spec.kind is TokenizerKind.HF:
        tokenizer = HFTokenizer(HFTokenizerSource(
            tokenizer_json=tokenizer_json, vocab_size=spec.vocab_size, eos_token_id=spec.eos_token_id,
            add_bos_token=spec.add_bos_token, add_eos_token=spec.add_eos_token, special_tokens=special_tokens))
    else:
        tokenizer = ByteTokenizer.from_spec(vocab_size=spec.vocab_size, eos_token_id=spec.eos_token_id,
                                            bos_token_id=spec.bos_token_id)
    template = ChatTemplate(spec.chat_template, special_tokens) if spec.chat_template else None
    return ModelText(tokenizer, template)
