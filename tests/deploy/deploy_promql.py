"""PromQL as text: which metric names and labels an expression uses, and promtool syntax checks."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import yaml
from deploy_tools import run

# Labels Prometheus attaches when scraping (deploy/observability/prometheus/*.yml relabels them).
TARGET_LABELS = {"job", "instance", "namespace", "pod"}
_NAME = re.compile(r"\binfermesh[_:][A-Za-z0-9_:]*")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_SELECTOR = re.compile(r"\{([^{}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def series_of(contract: Mapping[str, dict]) -> dict[str, dict]:
    """Every series name a contract metric puts in Prometheus -> its contract entry."""
    out = {}
    for name, metric in contract.items():
        suffixes = HISTOGRAM_SUFFIXES if metric["type"] == "histogram" else ("",)
        out.update({name + suffix: metric for suffix in suffixes})
    return out


def metric_names(expr: str) -> set[str]:
    return set(_NAME.findall(_STRING.sub('""', expr)))


def label_names(expr: str) -> set[str]:
    """Labels named in by()/without() clauses and in selectors' matchers."""
    bare = _STRING.sub('""', expr)
    labels = {label.strip() for group in _GROUPING.findall(bare) for label in group.split(",") if label.strip()}
    labels |= {label for selector in _SELECTOR.findall(bare) for label in _MATCHER.findall(selector)}
    return labels


def unknown_names(expr: str, contract: Mapping[str, dict], recorded: set[str] = frozenset()) -> set[str]:
    return {name for name in metric_names(expr) if name not in series_of(contract) and name not in recorded}


def unknown_labels(expr: str, contract: Mapping[str, dict]) -> set[str]:
    """Labels the expression uses that none of its contract metrics (nor the scrape) carry."""
    series = series_of(contract)
    allowed = set(TARGET_LABELS)
    for name in metric_names(expr):
        if name in series:
            allowed |= set(series[name]["labels"])
            if name.endswith("_bucket") and series[name]["type"] == "histogram":
                allowed.add("le")
    return label_names(expr) - allowed


def promtool_check_exprs(promtool: str, exprs: Mapping[str, str], workdir: Path) -> tuple[bool, str]:
    """Parse each expression with promtool by wrapping it in a recording rule."""
    rules = [{"record": f"check:expr_{i}", "expr": expr} for i, expr in enumerate(exprs.values())]
    path = workdir / "exprs.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "check", "rules": rules}]}))
    done = run([promtool, "check", "rules", str(path)])
    legend = "\n".join(f"check:expr_{i} = {where}" for i, where in enumerate(exprs))
    return done.returncode == 0, f"{done.stdout}{done.stderr}\n{legend}"
