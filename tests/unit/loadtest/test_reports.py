"""Report files: JSON (versioned schema), Markdown, self-contained HTML; and the `run`/`render` CLI."""

import base64
import json
import re

from loadtest import REPORT_SCHEMA
from loadtest.cli import EXIT_NOT_READY, EXIT_OK, main
from loadtest.execute import report_stem, write_reports
from loadtest.records import OK
from loadtest.report_json import REQUIRED_GROUP_KEYS, REQUIRED_TOP_KEYS, build_report, load_report
from loadtest.report_text import terminal_summary
from loadtest.runner import RunResult
from loadtest.scenario import RequestKind, load_scenario
from tests.unit.loadtest.conftest import fake_gateway_in_thread, make_record

DEMO = "loadtest/scenarios/demo.yaml"
SMOKE = "loadtest/scenarios/smoke.yaml"


def _demo_report() -> dict:
    """The demo scenario's report over synthetic records: 10 s of classify and generate traffic."""
    scenario = load_scenario(DEMO).with_duration(10.0)
    records = []
    for i in range(200):
        scheduled_s = scenario.warmup_s + i * 0.05
        if i % 10 == 0:
            times = tuple(scheduled_s + 0.05 + 0.01 * k for k in range(8))
            records.append(make_record(i, scheduled_s=scheduled_s, class_name="generate-short",
                                       kind=RequestKind.GENERATE, done_s=times[-1] + 0.001, chunk_times_s=times,
                                       num_output_tokens=8, server_ttft_us=45_000, tenant="beta"))
        else:
            status = "UNAVAILABLE" if i % 37 == 0 else OK
            records.append(make_record(i, latency_s=0.004 + (i % 50) * 0.001, scheduled_s=scheduled_s,
                                       status=status, message="no worker" if status != OK else ""))
    records.append(make_record(999, scheduled_s=1.0, measured=False))  # warm-up
    result = RunResult(tuple(records), tuple([300] * 190), scenario.duration_s)
    return build_report(scenario, result, target="127.0.0.1:1", started_at="2025-01-02T03:04:05+00:00")


def test_report_files_are_produced_and_valid(tmp_path):
    doc = _demo_report()
    paths = write_reports(doc, tmp_path, report_stem(doc))
    assert paths["json"].name == "demo-20250102T030405Z.json"

    parsed = json.loads(paths["json"].read_text())
    assert parsed["schema"] == REPORT_SCHEMA == "infermesh.loadtest/v1"
    assert set(REQUIRED_TOP_KEYS) <= parsed.keys()
    for group in [parsed["overall"], *parsed["classes"].values(), *parsed["tenants"].values()]:
        assert set(REQUIRED_GROUP_KEYS) <= group.keys()
    assert load_report(paths["json"]) == parsed
    assert parsed["meta"]["num_warmup_requests"] == 1
    assert "demo-key-alpha" not in paths["json"].read_text()  # keys stay out of reports
    assert parsed["classes"]["classify-small"]["errors"] == {"UNAVAILABLE": 5}
    assert parsed["classes"]["generate-short"]["stream"]["num_streams"] == 20
    assert len(parsed["windows"]["overall"]) == 10

    md = paths["md"].read_text()
    assert md.startswith("# Load test: demo")
    assert "| class classify-small |" in md and "### Streams (ms)" in md and "UNAVAILABLE" in md

    page = paths["html"].read_text()
    images = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    assert len(images) == 4  # latency over time, throughput, CDF, stage bars
    assert all(base64.b64decode(img).startswith(b"\x89PNG\r\n\x1a\n") for img in images)
    assert "<table>" in page and not re.search(r"(src|href)=['\"]?(https?:|//)", page)  # self-contained


def test_terminal_summary_shows_groups_streams_stages_and_errors():
    text = terminal_summary(_demo_report())
    assert "generator: on schedule" in text
    for needle in ("overall", "class classify-small", "tenant beta", "priority critical", "Streams (ms)",
                   "Per-stage mean", "Errors by status code", "tail owner"):
        assert needle in text, needle


def test_run_cli_against_a_fake_gateway_writes_all_reports(tmp_path, capsys):
    with fake_gateway_in_thread() as (servicer, address):
        code = main(["run", SMOKE, "--target", address, "--duration-s", "1", "--warmup-s", "0",
                     "--out", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert code == EXIT_OK
    assert "class generate-short" in out and "html report:" in out
    (json_path,) = tmp_path.glob("smoke-*.json")
    doc = load_report(json_path)
    assert doc["overall"]["num_requests"] == 3 and doc["overall"]["num_ok"] == 3  # 4 rps, constant, 1 s
    assert servicer.num_classify + servicer.num_generate == 3
    assert {p.suffix for p in tmp_path.iterdir()} == {".json", ".md", ".html"}

    assert main(["render", str(json_path), "--out", str(tmp_path / "again")]) == EXIT_OK
    assert (tmp_path / "again" / f"{json_path.stem}.html").exists()


def test_run_cli_fails_fast_when_the_target_does_not_serve_the_models(tmp_path, capsys):
    scenario = tmp_path / "other.yaml"
    scenario.write_text(
        "duration_s: 1\nload: {rate_rps: 1}\ntenants: [{api_key: k}]\n"
        "classes: [{kind: classify, model: nosuchmodel}]\n")
    with fake_gateway_in_thread() as (servicer, address):
        code = main(["run", str(scenario), "--target", address, "--wait-ready-s", "0.5", "--no-progress",
                     "--out", str(tmp_path)])
    assert code == EXIT_NOT_READY
    assert "nosuchmodel" in capsys.readouterr().err
    assert servicer.num_classify == 0
