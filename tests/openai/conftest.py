"""One mesh for every test in tests/openai: a scheduler (with /metrics), a toy generator worker
(20 ms per step, so a stream of a few hundred tokens is still running when a test acts on it) and
a gateway with its OpenAI-compatible HTTP port (HTTPS with the session's dev CA).

The gateway admits at most 2 requests at once and sheds sheddable traffic from 1 in flight
(`--max-in-flight 2 --shed-in-flight-at 0.5,1.0`), so one held stream is enough to show 503s. It
stores Responses (`--responses-store-bytes`, 1 MB) for test_stored_responses.py.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest

from tools.testbed import session_tls
from tools.testbed.gateway_fixtures import scrape, tenant, write_tenants
from tools.testbed.processes import free_port, running_mesh, wait_until

MODEL = "toy-generator"
KEYS = {name: f"openai-{name}-key" for name in ("alpha", "narrow", "ratelimited", "cheap", "modest")}
STEP_MS = 20


@dataclass
class HttpMesh:
    mesh: object
    base_url: str  # https://127.0.0.1:<port>/v1
    ca_path: str
    scheduler_metrics_port: int
    gateway_metrics_port: int

    def kv_usage(self) -> float:
        return scrape(self.scheduler_metrics_port).value("infermesh_scheduler_kv_cache_usage_ratio", model=MODEL)

    def running(self) -> float:
        return scrape(self.scheduler_metrics_port).value("infermesh_scheduler_running_sequences", model=MODEL)

    def wait_idle(self, timeout_s: float = 5.0) -> None:
        """The scheduler's metrics say no sequence runs and no KV block is held."""
        wait_until(lambda: self.running() == 0 and self.kv_usage() == 0, timeout_s=timeout_s, interval_s=0.02,
                   message="scheduler idle (no running sequence, no KV block in use)")

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.ca_path)

    def post(self, path: str, body, key: str | None = KEYS["alpha"], headers: dict | None = None,
             timeout_s: float = 30.0) -> tuple[int, dict, bytes]:
        """(status, headers, body) of one plain HTTPS request."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        sent = {"Content-Type": "application/json", **(headers or {})}
        if key is not None:
            sent["Authorization"] = f"Bearer {key}"
        return self.request("POST", path, data, sent, timeout_s)

    def request(self, method: str, path: str, data: bytes | None = None, headers: dict | None = None,
                timeout_s: float = 30.0) -> tuple[int, dict, bytes]:
        request = urllib.request.Request(self.base_url + path, data=data, headers=headers or {}, method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s, context=self.ssl_context()) as reply:
                return reply.status, dict(reply.headers), reply.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()


@pytest.fixture(scope="package")
def http_mesh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai-mesh")
    tenants = write_tenants(tmp / "tenants.yaml", [
        tenant("alpha", KEYS["alpha"]),
        tenant("narrow", KEYS["narrow"], allowed_models=["some-other-model"]),
        tenant("ratelimited", KEYS["ratelimited"], requests_per_s=0.2, requests_burst=1),
        tenant("cheap", KEYS["cheap"], "sheddable"),
        # A token burst above the model's context (512) and below a 100 000-character prompt.
        tenant("modest", KEYS["modest"], tokens_burst=5000),
    ])
    scheduler_metrics, gateway_metrics, http_port = free_port(), free_port(), free_port()
    with running_mesh(tmp) as mesh:
        mesh.start_scheduler("--metrics-port", str(scheduler_metrics))
        mesh.start_worker(MODEL, "--toy-compute-ms", str(STEP_MS))
        mesh.start_gateway("--tenants-file", str(tenants), "--http-port", str(http_port),
                           "--metrics-port", str(gateway_metrics), "--max-in-flight", "2",
                           "--shed-in-flight-at", "0.5,1.0", "--pressure-poll-interval-ms", "100",
                           "--responses-store-bytes", "1000000")
        served = HttpMesh(mesh, f"https://127.0.0.1:{http_port}/v1", str(session_tls.session_pki().ca_path),
                          scheduler_metrics, gateway_metrics)
        # The gateway learns of the model from its first poll of the scheduler.
        wait_until(lambda: MODEL in served.request("GET", "/models", headers={
            "Authorization": f"Bearer {KEYS['alpha']}"})[2].decode(), timeout_s=15, message="model listed")
        yield served
