"""docs/operations.md stays in step with what deploy/ ships: the metric contract, the alerts,
the recording rules."""

from __future__ import annotations

import re

import yaml
from deploy_tools import REPO

OPERATIONS = (REPO / "docs" / "operations.md").read_text()
RULE_FILES = sorted((REPO / "deploy" / "observability" / "prometheus" / "rules").glob("*.yml"))
SECTIONS = ("Deploying each service alone", "Rolling a new model version", "Draining a worker",
            "Reading the dashboard", "Alerts", "Metric contract")


def rules() -> list[dict]:
    return [rule for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


def test_operations_guide_has_every_section():
    headings = set(re.findall(r"^## (.+)$", OPERATIONS, flags=re.MULTILINE))
    assert set(SECTIONS) <= headings


def test_metric_table_is_the_contract(contract):
    rows = re.findall(r"^\| `(infermesh_\w+)` \| (\w+) \|([^|]*)\|", OPERATIONS, flags=re.MULTILINE)
    documented = {name: (kind, [label.strip() for label in labels.split(",") if label.strip()]) for name, kind, labels in rows}
    assert len(rows) == len(documented), "a metric is listed twice"
    assert documented == {name: (m["type"], m["labels"]) for name, m in contract.items()}


def test_every_alert_has_a_runbook_section_its_annotation_links_to():
    alerts = [rule for rule in rules() if "alert" in rule]
    headings = set(re.findall(r"^### (\w+)$", OPERATIONS, flags=re.MULTILINE))
    assert headings == {rule["alert"] for rule in alerts}
    for rule in alerts:
        # GitHub's anchor for "### Name" is "#name".
        assert rule["annotations"]["runbook_url"].endswith(f"/docs/operations.md#{rule['alert'].lower()}")


def test_recording_rules_are_listed():
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    listed = set(re.findall(r"`(infermesh:\w+:\w+)`", OPERATIONS))  # level:metric:operations; not key prefixes
    assert listed == recorded
