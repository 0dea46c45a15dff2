"""The load test against the real toy mesh: every request succeeds and carries the mesh's stage timings."""

from __future__ import annotations

import pytest

from loadtest.cli import EXIT_OK, main
from loadtest.report_json import load_report
from tools.testbed import session_tls

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCENARIO = """
name: toy-mesh
duration_s: 3
warmup_s: 1
load: {arrival: poisson, rate_rps: 12}
tenants:
  - {name: alpha, api_key: demo-key-alpha, share: 1}
  - {name: beta, api_key: demo-key-beta, share: 1}
classes:
  - {name: classify-png, kind: classify, model: toy-classifier, share: 3, deadline_ms: 5000,
     image: {size_px: 32, encoding: png, num_variants: 4}}
  - {name: classify-raw, kind: classify, model: toy-classifier, share: 2, deadline_ms: 5000,
     image: {size_px: 96, encoding: raw, num_variants: 4}}
  - {name: generate, kind: generate, model: toy-generator, share: 1, deadline_ms: 10000,
     prompt_len: {dist: uniform, min: 4, max: 16}, output_len: 6}
"""


def test_loadtest_run_against_the_toy_mesh(toy_mesh, tmp_path, capsys):
    scenario = tmp_path / "toy.yaml"
    scenario.write_text(SCENARIO)
    code = main(["run", str(scenario), "--target", toy_mesh.gateway.address, "--out", str(tmp_path),
                 "--no-progress", "--wait-ready-s", "20", "--ca-file", str(session_tls.session_pki().ca_path)])
    assert code == EXIT_OK, capsys.readouterr()
    (path,) = tmp_path.glob("toy-mesh-*.json")
    doc = load_report(path)
    overall = doc["overall"]
    assert overall["num_requests"] >= 20
    assert overall["num_errors"] == 0, overall["error_examples"]
    assert {"admission", "queue_wait", "compute"} <= set(overall["stages"])
    stream = doc["classes"]["generate"]["stream"]
    assert stream and stream["mean_output_tokens"] == 6 and stream["server_ttft_ms"]["count"] > 0
