"""The prefix-cache benchmark's workload: seeded conversations, prompts that resend their history,
and the oracle's hit rate."""

from __future__ import annotations

import statistics

import pytest

from bench.scheduler.prefix_workload import (
    OracleCache,
    WorkloadSpec,
    make_conversations,
    render_prompt,
    system_prompt,
    tenant_ids,
)


def encode(text: str) -> list[int]:
    return [257, *text.encode()]  # the byte tokenizer with its BOS, as tinylm's


def test_conversations_are_seeded_poisson_over_the_window_and_spread_over_every_tenant():
    spec = WorkloadSpec(conversations_per_s=50.0, duration_s=20.0, seed=3)
    conversations = make_conversations(spec)
    assert conversations == make_conversations(spec)
    starts = [c.start_s for c in conversations]
    assert starts == sorted(starts) and 0 <= starts[0] and starts[-1] < 20.0
    assert abs(len(conversations) - 1000) < 5 * 1000 ** 0.5
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(0.02, rel=0.1)
    assert {c.tenant_id for c in conversations} == set(tenant_ids(16))
    assert all(2 <= len(c.turns) <= 4 and c.turns[0].think_s == 0 for c in conversations)
    assert all(16 <= t.max_tokens <= 32 for c in conversations for t in c.turns)


def test_a_run_tag_gives_each_round_its_own_tenants():
    conversations = make_conversations(WorkloadSpec(), run_tag="r2-")
    assert all(c.tenant_id.startswith("r2-tenant-") for c in conversations)


def test_system_prompts_have_their_length_are_stable_and_differ_by_tenant():
    first = system_prompt("tenant-00", 500)
    assert len(first) == 500 and first == system_prompt("tenant-00", 500)
    assert first[:100] != system_prompt("tenant-01", 500)[:100]


def test_each_turn_starts_with_the_previous_turns_prompt_and_answer():
    system = system_prompt("tenant-00", 500)
    turn1 = render_prompt(system, [], "where is my order?")
    turn2 = render_prompt(system, [("where is my order?", " It shipped.")], "and the invoice?")
    assert turn1.startswith(system)
    assert turn2.startswith(turn1 + " It shipped.")
    assert turn2.endswith("\nUser: and the invoice?\nAssistant:")


def test_the_longest_prompt_bound_covers_every_rendered_prompt():
    spec = WorkloadSpec()
    answer = "x" * 32
    for conversation in make_conversations(spec)[:50]:
        exchanges: list[tuple[str, str]] = []
        for turn in conversation.turns:
            prompt = render_prompt(system_prompt(conversation.tenant_id, 500), exchanges, turn.user_text)
            assert len(prompt) <= spec.max_prompt_chars(len(answer))
            exchanges.append((turn.user_text, answer))


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="turns must be 1 <= low <= high, got 3, 2"):
        WorkloadSpec(turns=(3, 2))
    with pytest.raises(ValueError, match="conversations_per_s and duration_s must be > 0"):
        WorkloadSpec(conversations_per_s=0)


def test_oracle_hits_every_full_block_a_same_tenant_sequence_had_before():
    oracle = OracleCache(block_size=4)
    assert oracle.add("a", list(range(10))) == 0  # asks about 2 full blocks, cold
    assert oracle.add("a", list(range(13))) == 2  # its first 2 blocks seen, the third new
    assert oracle.add("a", [0, 1, 2, 3, 9, 9, 9, 9, 9]) == 1  # diverges in the second block
    assert oracle.add("b", list(range(13))) == 0  # another tenant: nothing shared
    assert (oracle.num_blocks, oracle.num_hit_blocks) == (2 + 3 + 2 + 3, 3)
    assert oracle.block_hit_rate == pytest.approx(0.3)
    assert oracle.token_hit_rate == pytest.approx(12 / (10 + 13 + 9 + 13))


def test_oracle_never_asks_about_the_block_of_the_prompts_last_token():
    oracle = OracleCache(block_size=4)
    oracle.add("a", list(range(8)))
    assert oracle.add("a", list(range(8))) == 1  # the second block holds the last token: computed anyway
    assert oracle.num_blocks == 2


def test_oracle_counts_an_answer_the_next_turn_resends_as_seen():
    oracle = OracleCache(block_size=4)
    oracle.add("a", [1, 2, 3], output_ids=[4, 5, 6, 7, 8])  # the answer completes blocks 1 and 2
    assert oracle.add("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]) == 2


def test_oracle_of_a_conversation_hits_its_system_prompt_and_history():
    system = system_prompt("tenant-00", 500)
    turn1 = render_prompt(system, [], "where is my order?")
    turn2 = render_prompt(system, [("where is my order?", " It shipped.")], "and the invoice?")
    oracle = OracleCache(block_size=16).add_all([("tenant-00", encode(turn1), encode(" It shipped.")[1:]),
                                                 ("tenant-00", encode(turn2), ())])
    assert oracle.num_hit_blocks == len(encode(turn1 + " It shipped.")) // 16
    assert OracleCache(16).block_hit_rate == 0.0
