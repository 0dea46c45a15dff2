"""docs/models.md "Serve your own TorchScript or ONNX model", run as written.

Every ```bash block of the section runs, in order, in one bash in a fresh directory
(tests/support/doc_walkthrough.py). The one change: the ports in step 3's `export` line become
free ones, so the walk-through can run beside other tests.
"""

from __future__ import annotations

import json

import pytest

from tests.support.doc_walkthrough import bash_blocks, run_script, with_free_ports

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SECTION = "## Serve your own TorchScript or ONNX model"


def test_the_walkthrough_runs_as_written(tmp_path):
    script = with_free_ports(bash_blocks("models.md", SECTION, num_blocks=4))
    run = run_script(script, cwd=tmp_path, timeout_s=240)
    assert run.returncode == 0, run.err_and_logs
    out = run.out
    lines = [line for line in out.splitlines() if line.startswith(("imported", "[", "{"))]
    assert lines[0] == "imported iris.onnx as iris/1 in my_models/iris/1", out
    assert lines[1] == "[{'name': 'x', 'datatype': 'FP32', 'dims': [-1, 4]}]"
    lines = lines[1:]
    metadata = json.loads(lines[1])
    assert metadata["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    probs = json.loads(lines[2])["outputs"][0]
    assert (probs["name"], probs["shape"]) == ("probs", [2, 3])
    assert abs(sum(probs["data"][:3]) - 1) < 1e-5
    top = json.loads(lines[3])["outputs"][0]
    assert (top["datatype"], top["shape"]) == ("BYTES", [1, 2]) and all(":" in e for e in top["data"])
    assert "input 'x' must be FP32, got FP64" in json.loads(lines[4])["error"]
    assert (tmp_path / "my_models" / "iris" / "1" / "iris.onnx").is_file()
