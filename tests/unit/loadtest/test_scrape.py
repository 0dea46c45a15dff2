"""Scraping Prometheus endpoints during a run and showing the series beside latency."""

from __future__ import annotations

import json

import pytest

from loadtest.cli import EXIT_OK, main
from loadtest.report_json import load_report
from loadtest.scrape import Sample, Scraper, parse_samples
from tests.unit.loadtest.test_cli_targets import fake_openai_in_thread

PAGE = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3
# TYPE infermesh_scheduler_kv_cache_usage_ratio gauge
infermesh_scheduler_kv_cache_usage_ratio{model="tinylm"} 0.25
# TYPE infermesh_queue_wait_seconds histogram
infermesh_queue_wait_seconds_bucket{le="0.1"} 4
infermesh_queue_wait_seconds_count 4
"""


def test_parse_keeps_matching_samples_and_never_buckets():
    samples = parse_samples(PAGE, ("vllm:num_requests_*", "infermesh_*kv_cache_usage*", "infermesh_*queue*"))
    assert samples == [Sample("vllm:num_requests_running", (("model_name", "m"),), 3.0),
                       Sample("infermesh_scheduler_kv_cache_usage_ratio", (("model", "tinylm"),), 0.25),
                       Sample("infermesh_queue_wait_seconds_count", (), 4.0)]
    with pytest.raises(ValueError):
        parse_samples("not a metric line {{", ("*",))


def test_scraper_refuses_a_url_that_is_not_http():
    with pytest.raises(ValueError, match="expected an http"):
        Scraper(("127.0.0.1:9090",))


def test_run_scrapes_the_server_and_reports_the_series(tmp_path, capsys):
    scenario = tmp_path / "s.yaml"
    scenario.write_text(json.dumps({
        "name": "scraped", "duration_s": 1.5, "load": {"arrival": "constant", "rate_rps": 20},
        "tenants": [{"api_key": "k"}],
        "classes": [{"name": "gen", "kind": "generate", "model": "tinylm", "prompt_len": 8, "output_len": 4}]}))
    with fake_openai_in_thread(token_s=0.02) as (server, url):
        base = url.removeprefix("openai+").removesuffix("/v1")
        code = main(["run", str(scenario), "--target", url, "--out", str(tmp_path), "--no-progress",
                     "--scrape", f"{base}/metrics", "http://127.0.0.1:9/metrics", "--scrape-interval-s", "0.25"])
        assert code == EXIT_OK, capsys.readouterr()
    doc = load_report(next(tmp_path.glob("scraped-*.json")))
    section = doc["server_metrics"]
    ours, dead = section["endpoints"]
    assert ours["num_scrapes"] >= 6 and ours["num_errors"] == 0
    assert dead["num_errors"] == dead["num_scrapes"] > 0 and dead["last_error"]  # counted, the run went on
    (running,) = section["series"]  # the counter does not match the default patterns
    assert running["name"] == "vllm:num_requests_running" and running["labels"] == {"model_name": "tinylm"}
    assert max(v for _, v in running["points"]) >= 1  # 20/s x 80 ms: requests were in flight
    times = [t for t, _ in running["points"]]
    assert times == sorted(times) and times[-1] <= doc["meta"]["duration_s"] + 1
    assert "Server metrics (scraped every 0.25 s)" in next(tmp_path.glob("scraped-*.md")).read_text()
    assert "Server metrics (scraped) beside latency" in next(tmp_path.glob("scraped-*.html")).read_text()
