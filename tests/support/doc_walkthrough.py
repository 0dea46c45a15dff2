"""Run a walk-through of docs/ as written: its section's ```bash blocks, in order, in one bash.

The repository's python is first on PATH and the repository on PYTHONPATH. The one change every
walk-through gets is free ports on its `export SCHEDULER_PORT=… HTTP_PORT=…` line, so it can run
beside other tests; whatever the script leaves running is ended with its process group.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tools.testbed.processes import ROOT, free_port

PORTS_LINE = re.compile(r"^export SCHEDULER_PORT=\d+ WORKER_PORT=\d+ GATEWAY_PORT=\d+ HTTP_PORT=\d+$", re.MULTILINE)


@dataclass(frozen=True)
class ScriptRun:
    returncode: int
    out: str
    err_and_logs: str  # stderr, then the last 3000 characters of each *.log the script left in its directory


def bash_blocks(doc: str, heading: str, num_blocks: int) -> str:
    """The ```bash blocks of the section of docs/`doc` that starts at `heading`, joined in order."""
    text = (ROOT / "docs" / doc).read_text()
    section = text[text.index(heading):]
    following = section.find("\n## ", len(heading))
    section = section if following < 0 else section[:following]
    blocks = re.findall(r"^```bash\n(.*?)^```$", section, flags=re.MULTILINE | re.DOTALL)
    assert len(blocks) == num_blocks, f"the walk-through has {num_blocks} steps with commands"
    return "\n".join(blocks)


def with_free_ports(script: str) -> str:
    """`script` with its one ports `export` line naming four free ports."""
    assert len(PORTS_LINE.findall(script)) == 1
    ports = (free_port(), free_port(), free_port(), free_port())
    return PORTS_LINE.sub("export SCHEDULER_PORT={} WORKER_PORT={} GATEWAY_PORT={} HTTP_PORT={}".format(*ports),
                          script)


def run_script(script: str, cwd: Path, timeout_s: float, extra_env: dict[str, str] | None = None) -> ScriptRun:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT), **(extra_env or {})}
    process = subprocess.Popen(["bash", "-e", "-c", script], cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout_s)
    finally:
        try:
            os.killpg(process.pid, signal.SIGTERM)  # the services, if the script stopped before its `kill`
        except ProcessLookupError:
            pass
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(cwd.glob("*.log")))
    return ScriptRun(process.returncode, out, err + logs)
