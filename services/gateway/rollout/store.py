"""Where rollout progress outlives the gateway: a JSON file the operator owns.

    {"models": {"digits": {"rollout_id": ..., "canary_version": "2", "state": "running",
                           "step_index": 2, "step_started_s": 1764240000.0, "by_hand": false,
                           "decisions": [{"action": "advance", "evidence": "...", ...}, ...]}}}

The decider gateway writes it whole after every decision (beside the file, then a rename, so a
reader never sees half of it); the other gateways and a restarted decider read it. Why a file and
not the quota store (Valkey): the progress is a few hundred bytes changed a few times per rollout,
an operator reads it (and may delete it to forget a rollout) with nothing but `cat`, it needs no
store to be up for a rollout to go on, and the routing file it belongs with is a file too. Every
replica that should follow it mounts it (a shared volume; docs/operations.md, "Rollouts").

A file that is missing is an empty store; one that cannot be read or parsed is logged and read as
empty (the rollouts then start from their first step), never a crash. A failed write is logged:
the decision stands in memory and the next one writes again.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


class FileRolloutStore:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def load(self) -> dict[str, dict]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError) as exc:
            log.error("rollout state file %s: cannot read (%s); starting rollouts afresh", self.path, exc)
            return {}
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            log.error("rollout state file %s: not JSON (%s); starting rollouts afresh", self.path, exc)
            return {}
        models = data.get("models") if isinstance(data, dict) else None
        if not isinstance(models, dict):
            log.error("rollout state file %s: no 'models' mapping; starting rollouts afresh", self.path)
            return {}
        return {str(model): record for model, record in models.items() if isinstance(record, dict)}

    def save(self, records: dict[str, dict]) -> None:
        staged = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            staged.write_text(json.dumps({"models": records}, indent=1, sort_keys=True), encoding="utf-8")
            os.replace(staged, self.path)
        except OSError as exc:
            log.error("rollout state file %s: cannot write (%s); the decision stands in memory", self.path, exc)
