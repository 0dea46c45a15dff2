"""docs/models.md "Serve your own TorchScript or ONNX model", run as written.

Every ```bash block of the section runs, in order, in one bash in a fresh directory, with the
repository's python first on PATH. The one change: the ports in step 3's `export` line become
free ones, so the walk-through can run beside other tests. Whatever the script leaves running is
ended with its process group.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tools.testbed.processes import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Serve your own TorchScript or ONNX model"
PORTS_LINE = re.compile(r"^export SCHEDULER_PORT=\d+ WORKER_PORT=\d+ GATEWAY_PORT=\d+ HTTP_PORT=\d+$", re.MULTILINE)


def walkthrough() -> str:
    text = (ROOT / "docs" / "models.md").read_text()
    section = text[text.index(SECTION):]
    following = section.find("\n## ", len(SECTION))
    section = section if following < 0 else section[:following]
    blocks = re.findall(r"^```bash\n(.*?)^```$", section, flags=re.MULTILINE | re.DOTALL)
    assert len(blocks) == 4, "the walk-through has four steps with commands"
    return "\n".join(blocks)


def test_the_walkthrough_runs_as_written(tmp_path):
    script = walkthrough()
    assert len(PORTS_LINE.findall(script)) == 1
    ports = (free_port(), free_port(), free_port(), free_port())
    script = PORTS_LINE.sub("export SCHEDULER_PORT={} WORKER_PORT={} GATEWAY_PORT={} HTTP_PORT={}".format(*ports),
                            script)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(["bash", "-e", "-c", script], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=240)
    finally:
        try:
            os.killpg(process.pid, signal.SIGTERM)  # the services, if the script stopped before its `kill`
        except ProcessLookupError:
            pass
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log")))
    assert process.returncode == 0, err + logs
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
