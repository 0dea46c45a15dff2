"""docs/models.md "Serve your own model", run as written on a generated tiny checkpoint.

Every ```bash block of the section runs, in order, in one bash in a fresh directory, with the
repository's python first on PATH. Two changes, both the reader's own: step 1's `export MODEL_DIR=`
line names the generated checkpoint, and step 3's `export` line gets free ports, so the
walk-through can run beside other tests. Whatever the script leaves running is ended with its
process group.
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

from tests.support.hf_checkpoints import save_model_directory
from tools.testbed.processes import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Serve your own model\n"
MODEL_DIR_LINE = re.compile(r"^export MODEL_DIR=\S+$", re.MULTILINE)
PORTS_LINE = re.compile(r"^export SCHEDULER_PORT=\d+ WORKER_PORT=\d+ GATEWAY_PORT=\d+ HTTP_PORT=\d+$", re.MULTILINE)


def walkthrough() -> str:
    text = (ROOT / "docs" / "models.md").read_text()
    section = text[text.index(SECTION):]
    section = section[:section.find("\n## ", len(SECTION))]
    blocks = re.findall(r"^```bash\n(.*?)^```$", section, flags=re.MULTILINE | re.DOTALL)
    assert len(blocks) == 4, "the walk-through has four steps with commands"
    return "\n".join(blocks)


def test_the_walkthrough_serves_a_generated_checkpoint(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    save_model_directory(checkpoint, "qwen2")
    script = walkthrough()
    assert len(MODEL_DIR_LINE.findall(script)) == 1 and len(PORTS_LINE.findall(script)) == 1
    script = MODEL_DIR_LINE.sub(f"export MODEL_DIR={checkpoint}", script)
    ports = (free_port(), free_port(), free_port(), free_port())
    script = PORTS_LINE.sub("export SCHEDULER_PORT={} WORKER_PORT={} GATEWAY_PORT={} HTTP_PORT={}".format(*ports),
                            script)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(["bash", "-e", "-c", script], cwd=work, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=300)
    finally:
        try:
            os.killpg(process.pid, signal.SIGTERM)  # the services, if the script stopped before its `kill`
        except ProcessLookupError:
            pass
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(work.glob("*.log")))
    assert process.returncode == 0, err + logs
    lines = [line for line in out.splitlines() if line.startswith(("imported", "{"))]
    assert lines[0].startswith(f"imported {checkpoint} as my-llm/1 in my_models: 256-token context"), out
    generated, completion = json.loads(lines[1]), json.loads(lines[2])
    assert generated["usage"]["completion_tokens"] == 16 or generated["finish_reason"] == "eos"
    assert completion["usage"]["completion_tokens"] == generated["usage"]["completion_tokens"]
    assert completion["choices"][0]["text"] == generated["text"]  # greedy both ways: the same tokens
