"""Server metrics during a run: Prometheus endpoints (ours or a peer's, such as vLLM's /metrics)
scraped every `interval_s`, the chosen series kept as points on the report's time axis.

Series are chosen by fnmatch patterns on the sample name (`vllm:num_requests_*`,
`*kv_cache_usage*`); histogram buckets and `_created` samples are never kept. A failed scrape
is counted and its message kept, and the run goes on: the load test measures the server, the
scraper only annotates. Times are seconds since warm-up ended, like the report's windows.
"""

from __future__ import annotations

import asyncio
import fnmatch
import ssl
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from loadtest.runner import Clock

# Queue depth, running sequences, KV-cache usage and batch sizes, as we and vLLM name them.
DEFAULT_SERIES = ("infermesh_*queue*", "infermesh_*waiting*", "infermesh_*running*", "infermesh_*kv_cache_usage*",
                  "infermesh_*in_flight*", "vllm:num_requests_*", "vllm:*cache_usage*")
MAX_SERIES = 32  # a pattern matching a label-rich family must not swamp the report
_SKIPPED_SUFFIXES = ("_bucket", "_created")


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


def parse_samples(text: str, patterns: tuple[str, ...]) -> list[Sample]:
    """The samples of a Prometheus text page whose names match a pattern. Raises ValueError for a bad page."""
    out = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(_SKIPPED_SUFFIXES) or not any(fnmatch.fnmatchcase(s.name, p) for p in patterns):
                continue
            out.append(Sample(s.name, tuple(sorted(s.labels.items())), float(s.value)))
    return out


@dataclass
class _Endpoint:
    url: str
    num_scrapes: int = 0
    num_errors: int = 0
    last_error: str = ""
    series: dict[tuple[str, tuple[tuple[str, str], ...]], list[list[float]]] = field(default_factory=dict)


class Scraper:
    def __init__(self, urls: tuple[str, ...], patterns: tuple[str, ...] = DEFAULT_SERIES, interval_s: float = 1.0,
                 ca_file: str = "") -> None:
        if not interval_s > 0:
            raise ValueError(f"scrape interval must be > 0, got {interval_s}")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--scrape {url!r}: expected an http:// or https:// URL of a Prometheus endpoint")
        self._endpoints = [_Endpoint(url) for url in urls]
        self._patterns = patterns
        self.interval_s = interval_s
        self._ca_file = ca_file

    async def run(self, clock: Clock, zero_s: float) -> None:
        """Scrapes until cancelled; `zero_s` is the clock time that reads as t = 0 (the end of warm-up)."""
        context = ssl.create_default_context(cafile=self._ca_file or None)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as session:
            next_s = clock.now_s()
            while True:
                await asyncio.gather(*(self._scrape(session, e, clock, zero_s) for e in self._endpoints))
                next_s += self.interval_s
                await clock.sleep_until(next_s)

    async def _scrape(self, session: aiohttp.ClientSession, endpoint: _Endpoint, clock: Clock, zero_s: float) -> None:
        """Counts a scrape once it has ended: one still waiting when the run ends is neither a scrape nor an error."""
        try:
            async with session.get(endpoint.url, timeout=aiohttp.ClientTimeout(total=self.interval_s)) as reply:
                text = await reply.text()
                if reply.status != 200:
                    raise ValueError(f"HTTP {reply.status}")
            t_s = round(clock.now_s() - zero_s, 3)
            samples = parse_samples(text, self._patterns)
            endpoint.num_scrapes += 1
        except (aiohttp.ClientError, TimeoutError, ValueError) as err:
            endpoint.num_scrapes += 1
            endpoint.num_errors += 1
            endpoint.last_error = f"{type(err).__name__}: {err}"
            return
        for s in samples:
            key = (s.name, s.labels)
            if key in endpoint.series or len(endpoint.series) < MAX_SERIES:
                endpoint.series.setdefault(key, []).append([t_s, s.value])

    def section(self) -> dict:
        """The report's `server_metrics`."""
        return {
            "interval_s": self.interval_s,
            "patterns": list(self._patterns),
            "endpoints": [{"url": e.url, "num_scrapes": e.num_scrapes, "num_errors": e.num_errors,
                           "last_error": e.last_error} for e in self._endpoints],
            "series": [{"endpoint": e.url, "name": name, "labels": dict(labels), "points": points}
                       for e in self._endpoints for (name, labels), points in sorted(e.series.items())],
        }
