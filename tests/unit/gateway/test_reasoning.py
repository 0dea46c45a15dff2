"""Reasoning split from the answer as vLLM's qwen3 and deepseek_r1 parsers split it: whole outputs'
edge cases, and any chunking of a stream (tags cut at every character) giving what the whole gives,
with no part of a tag ever passed on."""

from __future__ import annotations

import dataclasses
import random

import pytest

from services.common.reasoning_formats import DEEPSEEK_R1, QWEN3
from services.gateway.fronts.reasoning import ReasoningFormat, ReasoningSplitter, split_reasoning
from services.gateway.fronts.tool_calls import AUTO, ChatTools, ToolCallSplitter

QWEN = ReasoningFormat(QWEN3)
QWEN_OPENED = ReasoningFormat(QWEN3, opened=True)
R1 = ReasoningFormat(DEEPSEEK_R1)

CASES = [
    # (format, output, reasoning, answer)
    (QWEN, "<think>\nsky: Rayleigh\n</think>\n\nIt scatters.", "\nsky: Rayleigh\n", "\n\nIt scatters."),
    (QWEN, "\n<think>a</think>b", "a", "b"),  # whitespace before the tag is dropped with it
    (QWEN, "It scatters.", "", "It scatters."),  # no block: all answer
    (QWEN, "It </think> scatters.", "", "It </think> scatters."),  # a stray end tag is answer, as written
    (QWEN, "<think></think>It scatters.", "", "It scatters."),  # empty reasoning
    (QWEN, "<think>cut off at max_tok", "cut off at max_tok", ""),  # no end: all reasoning
    (QWEN, "<thin", "", "<thin"),  # the output ended before a tag did: what it wrote
    (QWEN_OPENED, "sky: Rayleigh</think>It scatters.", "sky: Rayleigh", "It scatters."),
    (QWEN_OPENED, "<think>again</think>x", "again", "x"),  # a repeated opening is dropped
    (QWEN_OPENED, "cut off", "cut off", ""),
    (R1, "sky: Rayleigh</think>It scatters.", "sky: Rayleigh", "It scatters."),  # no <think> needed
    (R1, "<think>sky</think>It", "sky", "It"),
    (R1, "</think>only the end", "", "only the end"),
    (R1, "never ended", "never ended", ""),
    (R1, "a</think>b</think>c", "a", "b</think>c"),  # the first end ends it
    (ReasoningFormat(), "<think>a</think>b", "", "<think>a</think>b"),  # no parser named: all answer
    (ReasoningFormat("granite"), "<think>a</think>b", "", "<think>a</think>b"),  # one this gateway lacks
]


@pytest.mark.parametrize(("fmt", "text", "reasoning", "answer"), CASES)
def test_a_whole_output_splits_as_vllms_parser_splits_it(fmt, text, reasoning, answer):
    assert split_reasoning(text, fmt) == (reasoning, answer)


def streamed(fmt: ReasoningFormat, pieces: list[str], constrained: bool = False) -> tuple[list[str], list[str]]:
    splitter = ReasoningSplitter(fmt, constrained)
    reasonings, answers = [], []
    for i, piece in enumerate(pieces):
        reasoning, answer = splitter.feed(piece, i == len(pieces) - 1)
        reasonings.append(reasoning)
        answers.append(answer)
    assert splitter.reasoning == "".join(reasonings)
    return reasonings, answers


def chunkings(text: str, rng: random.Random) -> list[list[str]]:
    """Every cut into two (so each tag is cut at every character), characters one by one, and random cuts."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text) + [""]]
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6)))) if len(text) > 1 else []
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


@pytest.mark.parametrize(("fmt", "text", "reasoning", "answer"), CASES)
def test_any_chunking_gives_what_the_whole_gives_and_never_part_of_a_tag(fmt, text, reasoning, answer):
    rng = random.Random(text)
    for pieces in chunkings(text, rng):
        reasonings, answers = streamed(fmt, pieces)
        assert ("".join(reasonings), "".join(answers)) == (reasoning, answer), pieces
        # A field whose whole text has no "<" never got a piece with one: no tag's beginning leaked.
        for whole, parts in ((reasoning, reasonings), (answer, answers)):
            if "<" not in whole:
                assert all("<" not in part for part in parts), (pieces, parts)


def test_reasoning_streams_as_it_comes_holding_only_a_possible_tag():
    splitter = ReasoningSplitter(R1)
    assert splitter.feed("Rayleigh scat", False) == ("Rayleigh scat", "")
    assert splitter.feed("ters. </th", False) == ("ters. ", "")  # "</th" may begin the end tag
    assert splitter.feed("ink>Blue", False) == ("", "Blue")
    assert splitter.feed(" sky.", True) == ("", " sky.")
    assert splitter.reasoning == "Rayleigh scatters. "


def test_qwen3_holds_the_outputs_beginning_only_while_it_may_open_a_block():
    splitter = ReasoningSplitter(QWEN)
    assert splitter.feed("\n<thi", False) == ("", "")
    assert splitter.feed("s is no tag", False) == ("", "\n<this is no tag")


def test_a_constrained_output_is_answer_unless_the_grammar_spells_a_block_first():
    assert split_reasoning('{"a": 1}', R1, constrained=True) == ("", '{"a": 1}')
    assert split_reasoning('{"a": 1}', QWEN_OPENED, constrained=True) == ("", '{"a": 1}')
    assert split_reasoning("<think>r</think>{}", R1, constrained=True) == ("r", "{}")


def test_a_constrained_output_whose_grammar_waited_for_the_reasoning_splits_as_a_free_one():
    for fmt, text in ((R1, "sky</think>{}"), (QWEN_OPENED, "sky</think>{}"), (QWEN, "<think>sky</think>{}")):
        waited = dataclasses.replace(fmt, grammar_after_reasoning=True)
        assert split_reasoning(text, waited, constrained=True) == split_reasoning(text, fmt) == ("sky", "{}")
    assert split_reasoning("{}", ReasoningFormat(QWEN3, grammar_after_reasoning=True), constrained=True) == ("", "{}")


def test_tool_calls_are_read_from_the_answer_after_the_reasoning():
    text = '<think>The user wants <tool_call> weather.</think>\n<tool_call>{"name": "weather", "arguments": ' \
           '{"city": "Oslo"}}</tool_call>'
    for pieces in chunkings(text, random.Random(3))[::7]:
        reasoning_splitter, calls = ReasoningSplitter(QWEN), ToolCallSplitter(ChatTools(AUTO))
        made = []
        for i, piece in enumerate(pieces):
            _, answer = reasoning_splitter.feed(piece, i == len(pieces) - 1)
            made += calls.feed(answer, i == len(pieces) - 1, "hermes")[1]
        assert reasoning_splitter.reasoning == "The user wants <tool_call> weather."
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in made] == [("weather", '{"city": "Oslo"}')]
        assert calls.content == "\n"
