"""A benchmark stopped by SIGTERM runs its exits (stops what it started); a process it forked dies of the signal."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from tools.testbed.processes import ROOT

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from bench.harness.stop_signal import exit_on_sigterm
    exit_on_sigterm()
    started, told = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(told, b"!")  # a signal before Python's after-fork reset would be dropped with it
        time.sleep(30)
        os._exit(0)
    try:
        os.read(started, 1)
        os.kill(child, signal.SIGTERM)
        _, status = os.waitpid(child, 0)
        print("child", os.WTERMSIG(status) if os.WIFSIGNALED(status) else "exited", flush=True)
        print("ready", flush=True)
        time.sleep(30)
    finally:
        print("stopped what it started", flush=True)
""")


def test_sigterm_unwinds_the_benchmark_and_kills_a_forked_child():
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().split() == ["child", str(int(signal.SIGTERM))]
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert out.strip() == "stopped what it started"
    # As after Ctrl-C: Python ends an unhandled KeyboardInterrupt by dying of SIGINT.
    assert proc.returncode == -signal.SIGINT and "KeyboardInterrupt: signal 15" in err
