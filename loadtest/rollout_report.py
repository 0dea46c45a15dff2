"""A run that spans a rollout: the gateway's rollout decisions on the run's timeline.

`loadtest run --rollout-state-file PATH` reads the decider gateway's state file
(services/gateway/rollout/store.py) after the run and adds to the report

    "rollout": {"state_file": PATH, "decisions": [{"t_s", "model", "canary_version", "action",
                                                   "from_step", "to_step", "evidence"}, ...]}

with `t_s` in seconds from the end of the warm-up, the origin of the "Over time" windows, so the
window in which the error ratio or the p99 moved sits next to the decision that moved the share
(start, advance, roll_back, promote, or an override by hand). `t_s` is exact to about a second:
the report's start time has whole seconds and includes the wait for the gateway to be ready.
Only decisions made while the run lasted are kept. A key added within schema v1. The table
(Markdown, HTML, terminal) shows each judgement's counts and failed checks only; the JSON keeps
the whole evidence, every check with its p-value.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from loadtest.tables import Table


def rollout_section(doc: dict, state_file: str | Path) -> dict:
    """The report's "rollout" key from the state file; ValueError when the file is not one."""
    try:
        data = json.loads(Path(state_file).read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"--rollout-state-file: cannot read {state_file}: {err.strerror or err}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--rollout-state-file: {state_file} is not JSON ({err})") from None
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict):
        raise ValueError(f"--rollout-state-file: {state_file} has no 'models' mapping (not a rollout state file)")
    origin_s = dt.datetime.fromisoformat(doc["meta"]["started_at"]).timestamp() + doc["meta"]["warmup_s"]
    end_s = origin_s + doc["meta"]["duration_s"] + 1.0
    decisions = []
    for model, record in models.items():
        for d in record.get("decisions", []) if isinstance(record, dict) else []:
            at_s = d.get("at_s") if isinstance(d, dict) else None
            if not isinstance(at_s, int | float) or not origin_s - doc["meta"]["warmup_s"] - 1.0 <= at_s <= end_s:
                continue
            decisions.append({"t_s": round(at_s - origin_s, 2), "model": str(model),
                              **{k: str(d.get(k, "")) for k in ("canary_version", "action", "from_step", "to_step",
                                                                 "evidence")}})
    decisions.sort(key=lambda d: d["t_s"])
    return {"state_file": str(state_file), "decisions": decisions}


def short_evidence(evidence: str) -> str:
    """A judgement's evidence with only its counts and failed checks (the JSON keeps all of it):
    "canary n=102 baseline n=297 after 4.2 s; error_rate 4.90% vs 0.00% p=0.0011 FAIL"."""
    parts = evidence.split("; ")
    if not parts[0].startswith("canary n="):  # a start, or a decision by hand: short already
        return evidence
    failed = [p for p in parts[1:] if p.endswith(" FAIL")]
    return "; ".join([parts[0], *failed]) if failed else f"{parts[0]}; all {len(parts) - 1} checks passed"


def rollout_table(doc: dict) -> Table | None:
    rollout = doc.get("rollout")
    if not rollout:
        return None
    rows = tuple((f"{d['t_s']:.1f}", d["model"], d["canary_version"], d["action"],
                  d["from_step"] if d["from_step"] == d["to_step"] else f"{d['from_step']} -> {d['to_step']}",
                  short_evidence(d["evidence"])) for d in rollout["decisions"])
    return Table("Rollout decisions (t from the end of warm-up, as the windows)",
                 ("t (s)", "model", "canary", "action", "step", "evidence"), rows,
                 note="" if rows else f"no decision in {rollout['state_file']} while the run lasted")
