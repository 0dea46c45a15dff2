"""A reasoning model's output as reasoning and answer (vLLM's reasoning parsers), chunk after chunk
or whole, for the OpenAI chat path; no transport here.

The scheduler names the model's parser on a stream's first chunk (GenerateResponse.reasoning_parser,
services/common/reasoning_formats.py), whether the prompt left a think block open
(reasoning_opened), and, for a constrained output (sampling.structured: response_format, guided_*,
a required or named tool choice), whether its grammar waited for the reasoning to end
(grammar_after_reasoning). Where the output begins:
- the prompt opened a block, or the parser is deepseek_r1: inside reasoning. A `<think>` the model
  writes first anyway is dropped.
- qwen3 otherwise: reasoning only if the output begins with `<think>` (after whitespace); an output
  that does not is all answer, as older Qwen3 templates and non-thinking turns produce.
- a constrained output whose grammar waited for the reasoning (vLLM's way: the model reasons freely,
  the grammar holds what follows `</think>`): as above.
- a constrained output whose grammar held it from its first token (the model's tokenizer writes a
  think tag in pieces): the grammar shaped the whole output, so none is assumed to be reasoning; a
  `<think>` the grammar itself spells first still opens a block.
Reasoning runs to the first `</think>`; everything after it is answer, passed on as written.
Without a `</think>` (max_tokens reached mid-thought), the reasoning is all there is, as vLLM's
current qwen3 parser reads a truncated output. A tag split across chunks is never passed on in
part: a possible beginning of `<think>` or `</think>` is held until the next chunk tells.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from infermesh.v1 import gateway_pb2
from services.common.reasoning_formats import DEEPSEEK_R1, REASONING_PARSERS, THINK_END, THINK_START
from services.gateway.fronts.partial_tags import partial_tag_len


@dataclass(frozen=True)
class ReasoningFormat:
    """What a choice's first chunk named."""

    parser: str = ""  # "": nothing to split
    opened: bool = False  # the prompt ends inside a think block
    grammar_after_reasoning: bool = False  # a grammar held only what follows the reasoning

    @classmethod
    def of_chunk(cls, chunk: gateway_pb2.GenerateResponse) -> ReasoningFormat:
        return cls(chunk.reasoning_parser, chunk.reasoning_opened, chunk.grammar_after_reasoning)


NO_REASONING = ReasoningFormat()


class _Part(enum.Enum):
    HEAD = "head"  # whether the output opens a block is not known yet
    REASONING = "reasoning"
    ANSWER = "answer"


class ReasoningSplitter:
    """One choice's output split as it comes: feed() each chunk's text, the last with last=True;
    it returns the (reasoning, answer) text that chunk makes sure of. `reasoning` holds all of the
    reasoning so far."""

    def __init__(self, fmt: ReasoningFormat, constrained: bool = False) -> None:
        known = fmt.parser in REASONING_PARSERS
        self._part = _Part.HEAD if known else _Part.ANSWER
        free_reasoning = not constrained or fmt.grammar_after_reasoning
        self._reasoning_first = known and free_reasoning and (fmt.opened or fmt.parser == DEEPSEEK_R1)
        self._held = ""  # text that may begin a tag
        self._reasoning: list[str] = []

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    def feed(self, text: str, last: bool) -> tuple[str, str]:
        held, self._held = self._held + text, ""
        if self._part is _Part.HEAD:
            head = held.lstrip()
            if head.startswith(THINK_START):
                self._part, held = _Part.REASONING, head[len(THINK_START):]
            elif THINK_START.startswith(head) and not last:  # whitespace, or a tag begun
                self._held = held
                return "", ""
            else:
                self._part = _Part.REASONING if self._reasoning_first else _Part.ANSWER
        reasoning = ""
        if self._part is _Part.REASONING:
            end = held.find(THINK_END)
            if end < 0:
                keep = 0 if last else partial_tag_len(held, THINK_END)
                reasoning, self._held = held[:len(held) - keep], held[len(held) - keep:]
                held = ""
            else:
                reasoning, held = held[:end], held[end + len(THINK_END):]
                self._part = _Part.ANSWER
            self._reasoning.append(reasoning)
        return reasoning, held


def chat_message(message: dict, reasoning: str) -> dict:
    """A chat choice's `message` with its reasoning as vLLM returns it: `reasoning_content` (the
    name vLLM used first, and DeepSeek's API) and `reasoning` (vLLM's newer name) alike, null when
    there is none; a reply that only reasoned has null content, as in vLLM."""
    if reasoning and not message.get("content") and not message.get("tool_calls"):
        message = {**message, "content": None}
    return {**message, "reasoning_content": reasoning or None, "reasoning": reasoning or None}


def reasoning_delta(piece: str) -> dict:
    """A stream delta's reasoning fields (both names, as chat_message); none for no text."""
    return {"reasoning_content": piece, "reasoning": piece} if piece else {}


def split_reasoning(text: str, fmt: ReasoningFormat, constrained: bool = False) -> tuple[str, str]:
    """A whole output's (reasoning, answer)."""
    return ReasoningSplitter(fmt, constrained).feed(text, True)

