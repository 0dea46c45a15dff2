"""Where a grammar starts in a reasoning model's output, read from the output tokens alone: after the
first `</think>`, or, where the output is reasoning only if it opens a block, from its first token
when it does not; the same answer however the output's scan is split across steps."""

from __future__ import annotations

import pytest

from services.common.grammar_after_reasoning import GrammarAfterReasoning, GrammarScan

START, END = 421, 422  # the model's <think> and </think>
PROMPT = (1, 2, 3, START)  # a prompt's tokens come before the output and are never read
OPENED = GrammarAfterReasoning(END)  # the output begins as reasoning
MAY_OPEN = GrammarAfterReasoning(END, start_token_id=START)  # qwen3, a prompt that opened no block


@pytest.mark.parametrize(("after", "output", "start"), [
    (OPENED, [], None),  # the first token is reasoning: sampled freely
    (OPENED, [7, 8], None),
    (OPENED, [7, END], 2),  # the grammar's first token is the one after </think>
    (OPENED, [END], 1),
    (OPENED, [7, END, 9, END, 9], 2),  # the first </think> ends the block; a later one is the grammar's
    (OPENED, [START, 7, END, 9], 3),  # a <think> the model writes anyway is reasoning
    (MAY_OPEN, [], 0),  # the first token: the grammar's, or the block's opening (also_allowed)
    (MAY_OPEN, [9, 7], 0),  # it did not open one: the grammar holds it all
    (MAY_OPEN, [START], None),
    (MAY_OPEN, [START, 7, 8], None),
    (MAY_OPEN, [START, 7, END], 3),
    (MAY_OPEN, [9, END, START], 0),  # tags after a first token that opened nothing are the grammar's
])
def test_the_grammar_starts_after_the_first_end_of_the_block(after, output, start):
    assert after.grammar_start([*PROMPT, *output], len(output)) == start


def test_only_an_outputs_first_token_may_open_the_block_beside_the_grammars_tokens():
    assert MAY_OPEN.also_allowed(0) == START
    assert MAY_OPEN.also_allowed(1) is None
    assert OPENED.also_allowed(0) is None


@pytest.mark.parametrize("after", [OPENED, MAY_OPEN])
@pytest.mark.parametrize("output", [[START, 5, 6, 7, END, 9, 9, END], [5, 6, END, 7], [START, 5, 6, 7, 8]])
def test_a_scan_kept_across_steps_finds_what_a_fresh_read_of_the_tokens_finds(after, output):
    for step in (1, 2, 3):  # a step's worth of new output tokens at a time
        scan = GrammarScan(after)
        for num_generated in [*range(0, len(output), step), len(output)]:
            tokens = [*PROMPT, *output[:num_generated]]
            assert scan.grammar_start(tokens, num_generated) == after.grammar_start(tokens, num_generated)
