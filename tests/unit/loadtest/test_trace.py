"""Trace replay (Mooncake/AIPerf and infermesh JSONL) and synthetic shared prefixes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.cli import EXIT_OK, EXIT_USAGE, main
from loadtest.report_json import load_report
from loadtest.scenario import parse_scenario
from loadtest.trace import read_trace
from loadtest.workload import open_loop_plan


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _scenario_doc(**over) -> dict:
    doc = {"name": "replay", "tenants": [{"name": "a", "api_key": "key-a"}],
           "classes": [{"name": "chat", "kind": "generate", "model": "tinylm", "deadline_ms": 5000,
                        "slo": {"ttft_ms": 500}}]}
    doc.update(over)
    return doc


MOONCAKE = [{"timestamp": 1000, "input_length": 40, "output_length": 3, "hash_ids": [1, 2]},
            {"timestamp": 0, "input_length": 30, "output_length": 2, "hash_ids": [1, 2], "session_id": "s1"},
            {"timestamp": 2500, "input_length": 20, "output_length": 4, "hash_ids": [7]}]


def test_reads_mooncake_and_our_layout_in_time_order(tmp_path):
    entries = read_trace(Path(_jsonl(tmp_path / "m.jsonl", MOONCAKE)))
    assert [e.t_s for e in entries] == [0.0, 1.0, 2.5] and entries[0].session == "s1"
    assert (entries[1].input_len, entries[1].output_len, entries[1].hash_ids) == (40, 3, (1, 2))
    ours = read_trace(Path(_jsonl(tmp_path / "o.jsonl", [
        {"t_s": 5.0, "prompt_len": 16, "output_len": 2, "prefix_group": "sys", "prefix_len": 10, "session": "u"},
        {"t_s": 5.5, "prompt_len": 12, "output_len": 1}])))
    assert [e.t_s for e in ours] == [0.0, 0.5] and ours[0].prefix_group == "sys" and ours[0].prefix_len == 10


@pytest.mark.parametrize(("line", "complaint"), [
    ("{not json", "not JSON"),
    ("[1]", "expected a JSON object"),
    ('{"when": 1}', "neither layout"),
    ('{"timestamp": -1, "input_length": 1, "output_length": 1}', "timestamp must be a number >= 0"),
    ('{"timestamp": 1, "input_length": 0, "output_length": 1}', "input_length must be an integer >= 1"),
    ('{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": ["a"]}', "hash_ids"),
    ('{"t_s": 0, "prompt_len": 4, "output_len": 1, "prefix_len": 9}', "prefix_len must be in"),
])
def test_a_bad_trace_line_is_refused_with_its_line_number(tmp_path, line, complaint):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"t_s": 0, "prompt_len": 4, "output_len": 1}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{complaint}"):
        read_trace(path)


def test_replay_plan_scales_time_keeps_lengths_and_shares_hash_id_blocks(tmp_path):
    path = _jsonl(tmp_path / "m.jsonl", MOONCAKE)
    scenario = parse_scenario(_scenario_doc(trace={"path": path, "speedup": 2, "block_tokens": 8}))
    plan = list(open_loop_plan(scenario))
    assert [p.scheduled_s for p in plan] == [0.0, 0.5, 1.25]
    assert [(len(p.payload.prompt), p.payload.max_tokens) for p in plan] == [(30, 2), (40, 3), (20, 4)]
    assert plan[0].payload.prompt[:16] == plan[1].payload.prompt[:16]  # blocks 1 and 2, 8 tokens each
    assert plan[0].payload.prompt[16:] != plan[1].payload.prompt[16:30]
    assert plan[2].payload.prompt[:8] != plan[0].payload.prompt[:8]  # block 7
    assert scenario.load.levels[0].duration_s == pytest.approx(1.25) and scenario.trace.class_name == "chat"


def test_prefix_groups_share_their_prefix_len(tmp_path):
    path = _jsonl(tmp_path / "o.jsonl", [
        {"t_s": 0, "prompt_len": 20, "output_len": 1, "prefix_group": "g", "prefix_len": 12},
        {"t_s": 1, "prompt_len": 30, "output_len": 1, "prefix_group": "g", "prefix_len": 12},
        {"t_s": 2, "prompt_len": 20, "output_len": 1, "prefix_group": "h", "prefix_len": 12}])
    plan = list(open_loop_plan(parse_scenario(_scenario_doc(trace={"path": path}))))
    a, b, c = (p.payload.prompt for p in plan)
    assert a[:12] == b[:12] != c[:12] and a[12:] != b[12:20]


def test_synthetic_prompts_share_the_given_ratio_among_the_given_prefixes():
    doc = _scenario_doc(load={"rate_rps": 200, "arrival": "constant"}, duration_s=1)
    doc["classes"][0] |= {"prompt_len": 100, "shared_prefix": {"ratio": 0.4, "num_prefixes": 2}}
    prompts = [p.payload.prompt for p in open_loop_plan(parse_scenario(doc))]
    assert all(len(p) == 100 for p in prompts)
    assert len({p[:40] for p in prompts}) == 2 and len({p[40:] for p in prompts}) > 100
    with pytest.raises(ValueError, match="ratio must be in"):
        doc["classes"][0]["shared_prefix"] = {"ratio": 1.5}
        parse_scenario(doc)


def test_trace_refusals(tmp_path):
    path = _jsonl(tmp_path / "m.jsonl", MOONCAKE)
    with pytest.raises(ValueError, match="not a generate class"):
        parse_scenario(_scenario_doc(trace={"path": path, "class": "nope"}))
    with pytest.raises(ValueError, match="no longer than the warm-up"):
        parse_scenario(_scenario_doc(trace={"path": path}, warmup_s=3))
    with pytest.raises(ValueError, match="cannot read"):
        parse_scenario(_scenario_doc(trace={"path": str(tmp_path / "missing.jsonl")}))


def test_run_replays_a_trace_against_an_openai_server(tmp_path, capsys):
    from tests.unit.loadtest.test_cli_targets import fake_openai_in_thread

    trace = _jsonl(tmp_path / "t.jsonl", [{"t_s": i * 0.02, "prompt_len": 8, "output_len": 3} for i in range(20)])
    scenario = tmp_path / "s.yaml"
    scenario.write_text(json.dumps(_scenario_doc(load={"rate_rps": 1})))  # --trace replaces its arrivals
    with fake_openai_in_thread() as (server, url):
        code = main(["run", str(scenario), "--target", url, "--trace", trace, "--speedup", "2", "--out", str(tmp_path),
                     "--no-progress", "--formats", "json"])
        assert code == EXIT_OK, capsys.readouterr()
        assert main(["run", str(scenario), "--target", url, "--trace", trace, "--rate-rps", "3"]) == EXIT_USAGE
    doc = load_report(next(tmp_path.glob("replay-*.json")))
    assert doc["overall"]["num_requests"] == 20 and doc["overall"]["num_ok"] == 20 and server.num_calls == 20
    assert doc["meta"]["trace"] == {"path": trace, "speedup": 2.0, "class": "chat", "num_requests": 20}
    assert doc["classes"]["chat"]["stream"]["mean_output_tokens"] == 3
