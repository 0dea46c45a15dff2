"""The load test against the real toy mesh, once per target kind the harness speaks: infermesh gRPC,
the OpenAI HTTP front (streamed and whole, completions and chat), KServe gRPC (ModelInfer and
ModelStreamInfer) and KServe REST. Every request succeeds; stages appear where the front reports them.

One mesh for the module (TLS on every port, the session's dev CA), runs of 2 s at 10 requests/s.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from loadtest.cli import EXIT_OK, main
from loadtest.report_json import SCHEMA_PATH, load_report
from tools.testbed import session_tls
from tools.testbed.processes import free_port, running_mesh

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TENANTS = """
tenants:
  - {name: alpha, api_key: demo-key-alpha, share: 1}
  - {name: beta, api_key: demo-key-beta, share: 1}
"""
CLASSIFY = """
  - {name: classify-png, kind: classify, model: toy-classifier, share: 3, deadline_ms: 5000,
     image: {size_px: 32, encoding: png, num_variants: 4}}
  - {name: classify-raw, kind: classify, model: toy-classifier, share: 2, deadline_ms: 5000,
     image: {size_px: 96, encoding: raw, num_variants: 4}}
"""
GENERATE = """
  - {name: generate, kind: generate, model: toy-generator, share: 1, deadline_ms: 10000,
     prompt_len: {dist: uniform, min: 4, max: 16}, output_len: 6}
"""
HTTP_GENERATE = """
  - {name: completions-stream, kind: generate, model: toy-generator, deadline_ms: 10000, prompt_len: 8, output_len: 6}
  - {name: chat-stream, kind: generate, model: toy-generator, deadline_ms: 10000, prompt_len: 8, output_len: 6,
     api: chat}
  - {name: completions-whole, kind: generate, model: toy-generator, deadline_ms: 10000, prompt_len: 8,
     output_len: 6, stream: false}
  - {name: chat-whole, kind: generate, model: toy-generator, deadline_ms: 10000, prompt_len: 8, output_len: 6,
     api: chat, stream: false}
"""


def _scenario(name: str, classes: str, rate_rps: float = 10, duration_s: float = 2) -> str:
    return (f"name: {name}\nduration_s: {duration_s}\nwarmup_s: 0.5\nload: {{arrival: poisson, rate_rps: {rate_rps}}}\n"
            f"{TENANTS}classes:{classes}")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loadtest-mesh")
    http_port, metrics_port = free_port(), free_port()
    with running_mesh(tmp) as mesh:
        mesh.start_scheduler("--metrics-port", str(metrics_port))
        mesh.start_worker("toy-classifier")
        mesh.start_worker("toy-generator")
        mesh.start_gateway("--max-message-bytes", str(256 * 1024), "--http-port", str(http_port))
        mesh.http_port = http_port
        mesh.metrics_port = metrics_port
        yield mesh


def _run(tmp_path, capsys, name: str, classes: str, target: str, *extra: str) -> dict:
    scenario = tmp_path / f"{name}.yaml"
    scenario.write_text(_scenario(name, classes))
    code = main(["run", str(scenario), "--target", target, "--out", str(tmp_path), "--no-progress",
                 "--wait-ready-s", "20", "--ca-file", str(session_tls.session_pki().ca_path), *extra])
    assert code == EXIT_OK, capsys.readouterr()
    (path,) = tmp_path.glob(f"{name}-*.json")
    doc = load_report(path)
    jsonschema.validate(doc, json.loads(SCHEMA_PATH.read_text()), cls=jsonschema.Draft202012Validator)
    return doc


def _all_ok(doc: dict, min_requests: int = 12) -> dict:
    overall = doc["overall"]
    assert overall["num_requests"] >= min_requests
    assert overall["num_errors"] == 0, overall["error_examples"]
    return overall


def test_grpc_target_reports_the_mesh_stages_and_the_scraped_scheduler_metrics(mesh, tmp_path, capsys):
    doc = _run(tmp_path, capsys, "grpc", CLASSIFY + GENERATE, f"grpc://{mesh.gateway.address}",
               "--scrape", f"http://127.0.0.1:{mesh.metrics_port}/metrics", "--scrape-interval-s", "0.5")
    overall = _all_ok(doc)
    assert doc["meta"]["target_kind"] == "grpc" and doc["meta"]["stages_reported"] is True
    assert {"admission", "queue_wait", "compute"} <= set(overall["stages"])
    stream = doc["classes"]["generate"]["stream"]
    assert stream and stream["mean_output_tokens"] == 6 and stream["server_ttft_ms"]["count"] > 0
    scraped = doc["server_metrics"]
    assert scraped["endpoints"][0]["num_scrapes"] >= 4 and scraped["endpoints"][0]["num_errors"] == 0
    names = {s["name"] for s in scraped["series"]}
    assert "infermesh_scheduler_kv_cache_usage_ratio" in names and all(s["points"] for s in scraped["series"])


def test_openai_target_streams_and_waits_on_completions_and_chat(mesh, tmp_path, capsys):
    doc = _run(tmp_path, capsys, "openai", HTTP_GENERATE, f"openai+https://127.0.0.1:{mesh.http_port}/v1")
    overall = _all_ok(doc)
    assert doc["meta"]["target_kind"] == "openai+http" and doc["meta"]["stages_reported"] is True
    # The gateway's timings ride on the last event (streamed) or the body and Server-Timing (whole).
    assert {"admission", "queue_wait", "compute"} <= set(overall["stages"])
    for name in ("completions-stream", "chat-stream", "completions-whole", "chat-whole"):
        group = doc["classes"][name]
        assert group["num_ok"] > 0, name
        assert group["stream"]["mean_output_tokens"] == 6, name  # usage, streamed or not
    streamed, whole = doc["classes"]["completions-stream"]["stream"], doc["classes"]["completions-whole"]["stream"]
    assert streamed["tpot_ms"]["count"] > 0 and streamed["itl_ms"]["count"] > 0
    assert whole["itl_ms"]["count"] == 0  # one reply, no gaps between chunks to measure


def test_kserve_grpc_target_infers_and_streams(mesh, tmp_path, capsys):
    doc = _run(tmp_path, capsys, "kserve-grpc", CLASSIFY + GENERATE, f"kserve+grpc://{mesh.gateway.address}")
    overall = _all_ok(doc)
    assert doc["meta"]["target_kind"] == "kserve+grpc"
    assert doc["meta"]["stages_reported"] is False and "queue_wait" not in overall["stages"]
    assert doc["classes"]["classify-png"]["num_ok"] > 0 and doc["classes"]["classify-raw"]["num_ok"] > 0
    stream = doc["classes"]["generate"]["stream"]
    assert stream["mean_output_tokens"] == 6 and stream["ttft_ms"]["count"] > 0


def test_kserve_http_target_infers_with_binary_tensors_and_reads_the_gateways_server_timing(mesh, tmp_path, capsys):
    doc = _run(tmp_path, capsys, "kserve-http", CLASSIFY, f"kserve+https://127.0.0.1:{mesh.http_port}")
    overall = _all_ok(doc)
    assert doc["meta"]["target_kind"] == "kserve+http" and doc["meta"]["stages_reported"] is True
    assert {"network", "queue_wait", "compute"} <= set(overall["stages"])  # from the gateway's Server-Timing
    assert doc["classes"]["classify-png"]["num_ok"] > 0 and doc["classes"]["classify-raw"]["num_ok"] > 0


def test_a_class_the_target_kind_cannot_serve_is_refused_before_any_request(mesh, tmp_path, capsys):
    scenario = tmp_path / "bad.yaml"
    scenario.write_text(_scenario("bad", CLASSIFY))
    code = main(["run", str(scenario), "--target", f"openai+https://127.0.0.1:{mesh.http_port}/v1",
                 "--out", str(tmp_path), "--no-progress"])
    assert code == 2
    assert "OpenAI target" in capsys.readouterr().err and not list(tmp_path.glob("bad-*.json"))


def test_ab_sets_the_grpc_and_openai_fronts_side_by_side(mesh, tmp_path, capsys):
    scenario = tmp_path / "ab.yaml"
    scenario.write_text(_scenario("ab", GENERATE, duration_s=1.5))
    code = main(["ab", str(scenario), "--target", f"grpc://{mesh.gateway.address}",
                 "--target", f"openai+https://127.0.0.1:{mesh.http_port}/v1", "--slice-s", "0.5", "--out",
                 str(tmp_path), "--no-progress", "--wait-ready-s", "20",
                 "--ca-file", str(session_tls.session_pki().ca_path)])
    assert code == EXIT_OK, capsys.readouterr()
    doc = json.loads(next(tmp_path.glob("ab-ab-*.json")).read_text())
    for side in ("a", "b"):
        _all_ok(doc[side], min_requests=5)
        assert doc[side]["classes"]["generate"]["stream"]["mean_output_tokens"] == 6
    assert {doc["a"]["meta"]["target_kind"], doc["b"]["meta"]["target_kind"]} == {"grpc", "openai+http"}
    metrics = {(c["group"], c["metric"]) for c in doc["comparison"]}
    assert {("overall", "p99"), ("class:generate", "ttft_p50")} <= metrics
    assert all(c["ratio"] is None or c["ratio"] > 0 for c in doc["comparison"])
