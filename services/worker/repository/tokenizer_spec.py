"""The generator's `tokenizer` block, one schema per tokenizer kind.

A new tokenizer kind is one dataclass with its own `from_json`/`to_json` and the fields every
tokenizer has (kind, vocab_size, eos_token_id, bos_token_id), registered in TOKENIZERS under
its `tokenizer.kind` string.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from services.common.reasoning_formats import REASONING_PARSERS
from services.common.tool_call_formats import TOOL_CALL_PARSERS
from services.worker.repository.json_fields import JsonFields, one_of
from services.worker.repository.pinned_file import PinnedFile

BYTES = "bytes"
HF = "hf"


@dataclass(frozen=True)
class TokenizerSpec:
    kind: str  # "bytes": id = UTF-8 byte value, specials above 255
    vocab_size: int
    eos_token_id: int
    bos_token_id: int  # -1: none

    @classmethod
    def from_json(cls, t: JsonFields) -> TokenizerSpec:
        t.allow_only(*(f.name for f in fields(cls)))
        vocab_size = t.integer("vocab_size", 257)
        eos = t.integer("eos_token_id", 256)
        bos = t.raw("bos_token_id")
        if bos != -1:
            bos = t.integer("bos_token_id", 256)
        if eos >= vocab_size or bos >= vocab_size or bos == eos:
            raise t.fail("eos_token_id", f"and bos_token_id must be distinct special ids < vocab_size {vocab_size}")
        return cls(BYTES, vocab_size, eos, bos)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class HFTokenizerSpec:
    """A Hugging Face tokenizer, run by the `tokenizers` library at the scheduler: the worker sends it
    tokenizer.json after its hello, with what tokenizer_config.json says (add_bos_token, special
    tokens, the chat template). The files stay as the model directory had them, each pinned."""

    kind: str  # "hf"
    vocab_size: int  # config.json's: the ids the model's output layer produces
    eos_token_id: int  # the first of generation_config.json's eos_token_id
    bos_token_id: int  # -1: none (the tokenizer's post-processor or add_bos_token decides what is prepended)
    # More ids that end a sequence as EOS does (Llama 3 Instruct also ends on <|eot_id|>).
    stop_token_ids: tuple[int, ...]
    tokenizer_json: PinnedFile  # tokenizer.json
    tokenizer_config: PinnedFile | None  # tokenizer_config.json, where the directory has one
    chat_template: PinnedFile | None  # chat_template.jinja, where the template is a file of its own
    # The format the model writes tool calls in (services/common/tool_call_formats.py), where its chat
    # template does not tell it; "": the scheduler tells it from the template.
    tool_call_parser: str = ""
    # How the model sets its reasoning apart (services/common/reasoning_formats.py); "": it does not
    # (or it is not split). The importer tells it from the chat template; unlike tool_call_parser,
    # "" here is final: the scheduler does not guess it.
    reasoning_parser: str = ""

    @classmethod
    def from_json(cls, t: JsonFields) -> HFTokenizerSpec:
        t.allow_only(*(f.name for f in fields(cls)))
        vocab_size = t.integer("vocab_size", 1)
        eos = t.integer("eos_token_id")
        bos = -1 if t.raw("bos_token_id") == -1 else t.integer("bos_token_id")
        stop = t.ints("stop_token_ids", 0, vocab_size, min_len=0)
        for key, value in (("eos_token_id", eos), ("bos_token_id", bos)):
            if value >= vocab_size:
                raise t.fail(key, f"must be < vocab_size {vocab_size}, got {value}")
        if eos in stop or len(set(stop)) != len(stop):
            raise t.fail("stop_token_ids", f"must be distinct ids other than eos_token_id {eos}, got {list(stop)}")
        optional = {key: PinnedFile.from_json(t.obj(key)) if t.data.get(key) is not None else None
                    for key in ("tokenizer_config", "chat_template")}
        parser = t.data.get("tool_call_parser") or ""
        if parser and parser not in TOOL_CALL_PARSERS:
            raise t.fail("tool_call_parser", f"must be {one_of(TOOL_CALL_PARSERS)}, got {parser!r}")
        reasoning = t.data.get("reasoning_parser") or ""
        if reasoning and reasoning not in REASONING_PARSERS:
            raise t.fail("reasoning_parser", f"must be {one_of(REASONING_PARSERS)}, got {reasoning!r}")
        return cls(HF, vocab_size, eos, bos, stop, PinnedFile.from_json(t.obj("tokenizer_json")), **optional,
                   tool_call_parser=parser, reasoning_parser=reasoning)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": HF, "vocab_size": self.vocab_size, "eos_token_id": self.eos_token_id,
            "bos_token_id": self.bos_token_id, "stop_token_ids": list(self.stop_token_ids),
            "tokenizer_json": self.tokenizer_json.to_json(),
            "tokenizer_config": None if self.tokenizer_config is None else self.tokenizer_config.to_json(),
            "chat_template": None if self.chat_template is None else self.chat_template.to_json(),
            **({"tool_call_parser": self.tool_call_parser} if self.tool_call_parser else {}),
            **({"reasoning_parser": self.reasoning_parser} if self.reasoning_parser else {}),
        }

    @property
    def pinned(self) -> tuple[PinnedFile, ...]:
        return tuple(f for f in (self.tokenizer_json, self.tokenizer_config, self.chat_template) if f is not None)


AnyTokenizerSpec = TokenizerSpec | HFTokenizerSpec
TOKENIZERS: dict[str, type[AnyTokenizerSpec]] = {BYTES: TokenizerSpec, HF: HFTokenizerSpec}


def parse_tokenizer(t: JsonFields) -> AnyTokenizerSpec:
    kind = t.text("kind")
    if kind not in TOKENIZERS:
        raise t.fail("kind", f"must be {one_of(TOKENIZERS)} (the tokenizers this worker serves), got {kind!r}")
    return TOKENIZERS[kind].from_json(t)
