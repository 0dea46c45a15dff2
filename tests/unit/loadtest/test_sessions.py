"""Multi-turn sessions: each later turn resends the conversation so far, a think time after the reply."""

from __future__ import annotations

import pytest

from loadtest.runner import LoadRunner, MonotonicClock
from loadtest.scenario import parse_scenario
from loadtest.targets.factory import open_target


def _scenario(**session) -> object:
    return parse_scenario({
        "name": "chat", "duration_s": 1.5, "seed": 4,
        "load": {"arrival": "constant", "rate_rps": 4},
        "tenants": [{"api_key": "k"}],
        "classes": [{"name": "chat", "kind": "generate", "model": "tinylm", "prompt_len": 6, "output_len": 3,
                     "deadline_ms": 5000, "api": "chat", "session": {"turns": 3, "think_time_ms": 50, **session}}]})


async def test_each_turn_resends_the_history_after_the_think_time(fake_openai):
    server, url = await fake_openai(chunk_text="x")
    scenario = _scenario()
    target = open_target(url, scenario, MonotonicClock(), "t")
    try:
        result = await LoadRunner(scenario, target).run()
    finally:
        await target.close()
    records = result.records
    assert all(r.ok for r in records) and len(records) == server.num_calls
    prompts = [b["messages"][0]["content"] for b in server.bodies]
    firsts = [p for p in prompts if len(p) == 6]
    assert len(firsts) >= 5  # 4/s for 1.5 s
    num_turns = []
    for first in firsts:
        turns = sorted((p for p in prompts if p.startswith(first)), key=len)
        num_turns.append(len(turns))
        for earlier, later_turn in zip(turns, turns[1:], strict=False):
            assert later_turn.startswith(earlier + "xxx\n") and len(later_turn) == len(earlier) + 3 + 1 + 6
    # Sessions started early finish their three turns; one started near the end stops at the end.
    assert max(num_turns) == 3 and num_turns.count(3) >= 3
    later = [r for r in records if r.seq >= 1 << 40]
    assert len(later) == sum(num_turns) - len(firsts)
    by_seq = sorted(records, key=lambda r: r.scheduled_s)
    # A later turn is due exactly the think time after its predecessor's reply ended.
    assert all(any(abs(r.scheduled_s - e.done_s - 0.05) < 1e-6 for e in by_seq) for r in later)


def test_session_fields_are_checked():
    with pytest.raises(ValueError, match="turns is required"):
        parse_scenario({"load": {"rate_rps": 1}, "tenants": [{"api_key": "k"}],
                        "classes": [{"kind": "generate", "model": "m", "session": {"think_time_ms": 5}}]})
    with pytest.raises(ValueError, match="applies to generate classes only"):
        parse_scenario({"load": {"rate_rps": 1}, "tenants": [{"api_key": "k"}],
                        "classes": [{"kind": "classify", "model": "m", "session": {"turns": 2}}]})
