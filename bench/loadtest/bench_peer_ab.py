"""The mesh against a server that is not ours, with `loadtest ab`: tinylm over the OpenAI API and
digits over KServe v2 REST, each the same scenario on both, their time slices interleaved.

    .venv/bin/python -m bench.loadtest.bench_peer_ab [--duration-s 20] [--generate-rps 4] [--classify-rps 20]
                                                    [--out bench/results/peer_ab]

Starts a plaintext mesh (scheduler, a tinylm and a digits worker, gateway with its HTTP port), then
the Ray Serve peer (bench/harness/ray_serve_peer.py, in .venv-rayserve: run
tests/integration/test_loadtest_peer.py once to build it), and runs `loadtest ab` with the mesh as
A and the peer as B. Writes the A/B reports (JSON, Markdown, HTML) under --out and prints the
comparison tables; stops every process it started.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from bench.harness.results import RESULTS_DIR
from loadtest.cli import main as loadtest
from tools.testbed.processes import ROOT, free_port, running_mesh, wait_until

PEER_PYTHON = ROOT / ".venv-rayserve" / "bin" / "python"

GENERATE = """name: tinylm-mesh-vs-ray
duration_s: {duration_s}
warmup_s: 2
seed: 7
load: {{arrival: poisson, rate_rps: {rate_rps}}}
tenants:
  - {{name: alpha, api_key: demo-key-alpha}}
classes:
  - {{name: completions-stream, kind: generate, model: tinylm, deadline_ms: 30000, temperature: 0.8,
     prompt_len: {{dist: uniform, min: 16, max: 48}}, output_len: 32, slo: {{ttft_ms: 1000, tpot_ms: 100, e2e_ms: 5000}}}}
"""
CLASSIFY = """name: digits-mesh-vs-ray
duration_s: {duration_s}
warmup_s: 2
seed: 7
load: {{arrival: poisson, rate_rps: {rate_rps}}}
tenants:
  - {{name: alpha, api_key: demo-key-alpha}}
classes:
  - {{name: classify-png, kind: classify, model: digits, deadline_ms: 5000, top_k: 3,
     image: {{size_px: 28, channels: 1, encoding: png, num_variants: 16}}, slo: {{e2e_ms: 250}}}}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration-s", type=float, default=20.0, help="each side's measured time")
    parser.add_argument("--generate-rps", type=float, default=4.0)
    parser.add_argument("--classify-rps", type=float, default=20.0)
    parser.add_argument("--out", default=str(RESULTS_DIR / "peer_ab"))
    args = parser.parse_args()
    if not PEER_PYTHON.exists():
        raise SystemExit(f"{PEER_PYTHON} is missing: run tests/integration/test_loadtest_peer.py once to build it")
    with tempfile.TemporaryDirectory() as tmp_name, running_mesh(Path(tmp_name), tls=False) as mesh:
        tmp = Path(tmp_name)
        http_port, peer_port = free_port(), free_port()
        mesh.start_scheduler()
        mesh.start_worker("tinylm")
        mesh.start_worker("digits")
        mesh.start_gateway("--http-port", str(http_port))
        # After the mesh: both starting at once on the 2-core box took a worker past its 60 s start.
        ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
        log = tmp / "peer.log"
        with open(log, "wb") as out:
            peer = subprocess.Popen([str(PEER_PYTHON), "-m", "bench.harness.ray_serve_peer", "--port", str(peer_port),
                                     "--temp-dir", ray_dir], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            wait_until(lambda: peer.poll() is not None or "READY" in log.read_text(errors="replace"), 300,
                       message="the Ray Serve peer READY")
            runs = [(GENERATE, args.generate_rps, "openai+http://127.0.0.1:{}/v1"),
                    (CLASSIFY, args.classify_rps, "kserve+http://127.0.0.1:{}")]
            for template, rate_rps, url in runs:
                scenario = tmp / "scenario.yaml"
                scenario.write_text(template.format(duration_s=args.duration_s, rate_rps=rate_rps))
                print(f"load average {os.getloadavg()}", flush=True)
                loadtest(["ab", str(scenario), "--target", url.format(http_port), "--target", url.format(peer_port),
                          "--slice-s", "1", "--out", args.out, "--no-progress", "--wait-ready-s", "30"])
            print(f"load average {os.getloadavg()}", flush=True)
        finally:
            stop_peer(peer)
            shutil.rmtree(ray_dir, ignore_errors=True)


def stop_peer(peer: subprocess.Popen) -> None:
    """SIGTERM (the peer shuts Serve and Ray down), then whatever is left in its process group."""
    peer.send_signal(signal.SIGTERM)
    try:
        peer.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(peer.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    peer.wait(timeout=10)


if __name__ == "__main__":
    main()
