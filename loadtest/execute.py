"""One load-test run end to end: open the target, preflight it, drive the scenario, build the report."""

from __future__ import annotations

import asyncio
import datetime as dt
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from loadtest.ab import SlicedTarget, ab_document, owned_time_s, split_records
from loadtest.progress import ProgressPrinter
from loadtest.report_html import html_report
from loadtest.report_json import build_report, side_windows, write_json
from loadtest.report_text import markdown_report
from loadtest.runner import LoadRunner, MonotonicClock, RunResult
from loadtest.scenario import LoadMode, Scenario
from loadtest.scrape import DEFAULT_SERIES, Scraper
from loadtest.targets.base import Target, TargetError
from loadtest.targets.factory import open_target


class TargetNotReady(Exception):
    """The target did not answer, or did not serve the scenario's models, within the wait."""


@dataclass(frozen=True)
class RunOptions:
    target: str  # HOST:PORT or a URL (loadtest/targets/address.py)
    progress: bool = True
    wait_ready_s: float = 10.0  # 0: do not preflight
    stream: TextIO = sys.stderr
    ca_file: str = ""  # PEM CA bundle: TLS to a gRPC target, or the roots an https target is verified against
    scrape_urls: tuple[str, ...] = ()  # Prometheus endpoints scraped during the run (loadtest/scrape.py)
    scrape_series: tuple[str, ...] = DEFAULT_SERIES
    scrape_interval_s: float = 1.0


async def wait_until_ready(target: Target, scenario: Scenario, wait_s: float, stream: TextIO) -> None:
    """Asks the target until every model the scenario uses is ready."""
    clock = MonotonicClock()
    deadline_s = clock.now_s() + wait_s
    api_key = scenario.tenants[0].api_key
    problem = ""
    while True:
        try:
            ready = await target.ready_models(scenario.models(), api_key, timeout_s=2.0)
            missing = sorted(scenario.models() - ready)
            if not missing:
                return
            problem = f"models not ready: {', '.join(missing)}"
        except TargetError as err:
            problem = str(err)
        if clock.now_s() >= deadline_s:
            raise TargetNotReady(problem)
        stream.write(f"waiting for the target: {problem}\n")
        await clock.sleep_until(min(deadline_s, clock.now_s() + 1.0))


async def run_scenario(scenario: Scenario, options: RunOptions) -> dict:
    started_at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    clock = MonotonicClock()
    run_id = "lt" + dt.datetime.now(dt.UTC).strftime("%H%M%S")
    target = open_target(options.target, scenario, clock, run_id, options.ca_file)
    try:
        if options.wait_ready_s > 0:
            await wait_until_ready(target, scenario, options.wait_ready_s, options.stream)
        printer = ProgressPrinter(options.stream, "rps" if scenario.load.mode is LoadMode.OPEN else "clients") \
            if options.progress else None
        scraper = Scraper(options.scrape_urls, options.scrape_series, options.scrape_interval_s, options.ca_file) \
            if options.scrape_urls else None
        scraping = asyncio.create_task(scraper.run(clock, clock.now_s() + scenario.warmup_s)) if scraper else None
        try:
            result = await LoadRunner(scenario, target, clock, on_progress=printer).run()
        finally:
            if scraping:
                scraping.cancel()
                await asyncio.gather(scraping, return_exceptions=True)
        if printer:
            printer.close()
    finally:
        await target.close()
    doc = build_report(scenario, result, target=options.target, started_at=started_at)
    if scraper:
        doc["server_metrics"] = scraper.section()
    return doc


def run_blocking(scenario: Scenario, options: RunOptions) -> dict:
    """Runs on uvloop when available (the servers use it too), else the default loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is pinned, but the harness should not depend on it
        return asyncio.run(run_scenario(scenario, options))
    return uvloop.run(run_scenario(scenario, options))


def write_reports(doc: dict, out_dir: Path, stem: str, formats: tuple[str, ...] = ("json", "md", "html")) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    if "json" in formats:
        paths["json"] = out_dir / f"{stem}.json"
        write_json(doc, paths["json"])
    if "md" in formats:
        paths["md"] = out_dir / f"{stem}.md"
        paths["md"].write_text(markdown_report(doc), encoding="utf-8")
    if "html" in formats:
        paths["html"] = out_dir / f"{stem}.html"
        paths["html"].write_text(html_report(doc), encoding="utf-8")
    return paths


def report_stem(doc: dict) -> str:
    """<scenario>-<UTC start time>, safe as a file name."""
    started = doc["meta"]["started_at"].replace(":", "").replace("-", "").replace("+0000", "Z")
    name = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in doc["meta"]["name"])
    return f"{name}-{started}"


async def run_ab(scenario: Scenario, options: RunOptions, target_b: str, slice_s: float) -> dict:
    """Both targets on one schedule of twice the scenario's duration, alternating every `slice_s`;
    returns the A/B document (loadtest/ab.py) holding a full report per target."""
    started_at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    clock = MonotonicClock()
    run_id = "ab" + dt.datetime.now(dt.UTC).strftime("%H%M%S")
    if scenario.trace is not None or scenario.load.mode is not LoadMode.OPEN:
        raise ValueError("ab interleaves an open-loop schedule; this scenario is a trace replay or closed-loop")
    doubled = scenario.with_duration(2 * scenario.duration_s)
    target_a = open_target(options.target, doubled, clock, run_id + "a", options.ca_file)
    try:
        target = SlicedTarget(target_a, open_target(target_b, doubled, clock, run_id + "b", options.ca_file), slice_s)
    except ValueError:
        await target_a.close()
        raise
    try:
        if options.wait_ready_s > 0:
            await wait_until_ready(target, doubled, options.wait_ready_s, options.stream)
        printer = ProgressPrinter(options.stream, "rps") if options.progress else None
        result = await LoadRunner(doubled, target, clock, on_progress=printer).run()
        if printer:
            printer.close()
    finally:
        await target.close()
    docs = []
    end_s = doubled.warmup_s + doubled.duration_s
    for side, (url, records) in enumerate(zip((options.target, target_b), split_records(result.records, slice_s),
                                              strict=True)):
        owned_s = owned_time_s(doubled.warmup_s, end_s, slice_s, side)
        doc = build_report(doubled, RunResult(records, result.lag_us, owned_s), target=url, started_at=started_at)
        doc["windows"] = side_windows(doubled, [r for r in records if r.measured], result.measured_s,
                                      doc["windows"]["window_s"])
        docs.append(doc)
    return ab_document(docs[0], docs[1], slice_s)
