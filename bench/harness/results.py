"""Where a benchmark's figures go, and the one way a report is written there.

Every benchmark writes one JSON document (default bench/results/<name>.json, its --output where it
has one); bench/baselines/ keeps the runs that docs quote.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "bench" / "results"
MODEL_REPO = ROOT / "model_repo"


def write_report(path: Path, report: object, *, default: Callable[[object], object] | None = None,
                 note: str = "") -> Path:
    """`report` as indented JSON at `path` (its folder made first); prints where it went, then `note`.

    `default`: how to write what json cannot (e.g. a NaN as null), as json.dumps takes it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=default) + "\n", encoding="utf-8")
    print(f"wrote {path}{note}")
    return path


def finite(value):
    """`value` with every NaN/inf float inside it as None, so its JSON is strict (null, not NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value
