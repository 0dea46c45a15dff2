"""docs/models.md "Serve your own model", run as written on a generated tiny checkpoint.

Every ```bash block of the section runs, in order, in one bash in a fresh directory
(tests/support/doc_walkthrough.py). Two changes, both the reader's own: step 1's `export MODEL_DIR=`
line names the generated checkpoint, and step 3's `export` line gets free ports, so the
walk-through can run beside other tests.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.support.doc_walkthrough import bash_blocks, run_script, with_free_ports
from tests.support.hf_checkpoints import save_model_directory

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SECTION = "## Serve your own model\n"
MODEL_DIR_LINE = re.compile(r"^export MODEL_DIR=\S+$", re.MULTILINE)


def test_the_walkthrough_serves_a_generated_checkpoint(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    save_model_directory(checkpoint, "qwen2")
    script = bash_blocks("models.md", SECTION, num_blocks=4)
    assert len(MODEL_DIR_LINE.findall(script)) == 1
    script = with_free_ports(MODEL_DIR_LINE.sub(f"export MODEL_DIR={checkpoint}", script))
    work = tmp_path / "work"
    work.mkdir()
    run = run_script(script, cwd=work, timeout_s=300, extra_env={"HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.err_and_logs
    out = run.out
    lines = [line for line in out.splitlines() if line.startswith(("imported", "{"))]
    assert lines[0].startswith(f"imported {checkpoint} as my-llm/1 in my_models: 256-token context"), out
    generated, completion = json.loads(lines[1]), json.loads(lines[2])
    assert generated["usage"]["completion_tokens"] == 16 or generated["finish_reason"] == "eos"
    assert completion["usage"]["completion_tokens"] == generated["usage"]["completion_tokens"]
    assert completion["choices"][0]["text"] == generated["text"]  # greedy both ways: the same tokens
