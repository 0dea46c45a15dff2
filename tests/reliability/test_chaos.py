"""One run of the chaos driver (tests/reliability/chaos.py; `make chaos` runs five): worker kill,
scheduler kill and restart, the other scheduler hung 6 s after that restart, the quota store killed,
both gateways rolled, all within ~30 s under open-loop load. Nothing may be lost."""

from __future__ import annotations

import pytest

from tests.reliability.chaos import log_findings, lost_report, run_once

pytestmark = pytest.mark.integration


def test_the_faults_close_together_lose_no_call(tmp_path):
    result = run_once(tmp_path, seed=35)
    print(result.line())
    assert result.notes == [], "every fault ran"
    problems = result.counts.problems()
    assert problems == dict.fromkeys(problems, 0), (
        f"lost, by status and message:\n{lost_report(result.counts)}\nthe services' logs ({tmp_path}):\n"
        f"{log_findings(tmp_path)}")
    assert result.counts.num_classify >= 1000
