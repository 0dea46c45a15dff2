"""Automatic rollouts on real processes: one mesh, mock-classifier version 1 (the baseline) and a
deliberately bad or good candidate per test (services/worker/mock_models.py's profiles):

  2  wrong answers at the same speed (label_shift)   -> caught at the shadow step, never served
  3  three times slower in compute (batch_ms 3x)     -> rolled back within the first step
  4  fails 5 % of requests (fail_every=20)           -> rolled back
  5  as good as version 1                            -> promoted to 100 % through every step
  2 again, with golden cases and no shadow step      -> rolled back by the golden check at the first step

Each test rewrites the routing file's rollout policy (the gateway reloads it) and drives
version-less traffic until the rollout decides; steps are short and minimum counts small."""

from __future__ import annotations

import base64
import json
import os
import random
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest
import yaml

from infermesh.v1 import admin_pb2, admin_pb2_grpc, common_pb2, gateway_pb2, gateway_pb2_grpc
from services.cli import main as cli
from services.common import admin_servicer
from services.worker.mock_models import mock_label_index
from tests.support.closed_loop import drive_until
from tools.testbed import session_tls
from tools.testbed.gateway_fixtures import scrape
from tools.testbed.processes import free_port, running_mesh, wait_until

pytestmark = pytest.mark.integration

MODEL = "mock-classifier"
BASE_MS = 4
CANDIDATES = {"2": f"batch_ms={BASE_MS},label_shift=3", "3": f"batch_ms={BASE_MS * 3}",
              "4": f"batch_ms={BASE_MS},fail_every=20", "5": f"batch_ms={BASE_MS}"}
FAST = {"min_requests": 20, "min_duration_s": 0.3, "confidence": 0.99, "shadow_max_in_flight": 8}


def golden_cases(num: int = 3) -> list[dict]:
    """Known inputs with version 1's answers (the manifest's golden format)."""
    pixels = [bytes([i + 1, 2 * i + 1, 7, i]) for i in range(num)]
    return [{"height": 2, "width": 2, "channels": 1, "pixels_b64": base64.b64encode(p).decode(),
             "expected_top1": mock_label_index(common_pb2.Image(raw=common_pb2.RawImage(pixels=p)))} for p in pixels]


def routing_text(rollout: dict | None) -> str:
    route: dict = {"default_version": "1", "versions": {v: {} for v in CANDIDATES}}
    if rollout is not None:
        route["rollout"] = {**FAST, **rollout}
    return yaml.safe_dump({"models": {MODEL: route}})


def _replace(path: Path, text: str) -> None:
    staged = path.with_suffix(".new")
    staged.write_text(text, encoding="utf-8")
    os.replace(staged, path)


class Mesh:
    def __init__(self, mesh, gateway, routing: Path, state: Path, metrics_port: int) -> None:
        self.mesh, self.gateway, self.routing, self.state, self.metrics_port = mesh, gateway, routing, state, metrics_port
        self.channel = gateway.channel() if hasattr(gateway, "channel") else grpc.insecure_channel(gateway.address)
        self.stub = gateway_pb2_grpc.InferenceStub(self.channel)
        self.num_reloads = 0

    def roll(self, **rollout) -> None:
        """Put a rollout policy in force (and wait until the gateway applied it)."""
        self.num_reloads += 1
        _replace(self.routing, routing_text(rollout))
        wait_until(lambda: scrape(self.metrics_port).value("infermesh_gateway_config_reloads_total",
                                                           file="routing", result="applied") >= self.num_reloads,
                   timeout_s=10, message="routing file reloaded")

    def saved(self) -> dict:
        return json.loads(self.state.read_text())["models"][MODEL]

    def drive(self, until, timeout_s: float = 60.0, num_threads: int = 4) -> Counter:
        """Version-less classify calls from `num_threads` threads until `until()`: versions (or codes) seen."""
        def classify(rng: random.Random) -> str:
            image = common_pb2.Image(raw=common_pb2.RawImage(pixels=rng.randbytes(4), height=2, width=2, channels=1))
            return self.stub.Classify(gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name=MODEL), image=image),
                                      timeout=10).model.version

        return drive_until(classify, until, num_threads=num_threads, timeout_s=timeout_s, message="rollout decision")


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rollouts")
    routing, state = tmp / "routing.yaml", tmp / "rollouts.json"
    routing.write_text(routing_text(None), encoding="utf-8")
    metrics_port = free_port()
    with running_mesh(tmp) as mesh:
        mesh.start_scheduler()
        mesh.start_worker(MODEL, "--mock-profile", f"batch_ms={BASE_MS}", "--model-version", "1")
        for version, profile in CANDIDATES.items():
            mesh.start_worker(MODEL, "--mock-profile", profile, "--model-version", version)
        gateway = mesh.start_gateway("--routing-file", str(routing), "--tenants-poll-interval-ms", "100",
                                     "--rollout-interval-ms", "100", "--rollout-state-file", str(state),
                                     "--metrics-port", str(metrics_port))
        served = Mesh(mesh, gateway, routing, state, metrics_port)
        # Every candidate attached and reported ready before a test relies on its share.
        wait_until(lambda: all(served.stub.Classify(gateway_pb2.ClassifyRequest(
            model=common_pb2.ModelRef(name=MODEL, version=v), image=common_pb2.Image(raw=common_pb2.RawImage(
                pixels=bytes(4), height=2, width=2, channels=1))), timeout=10).model.version == v
            for v in ("1", *CANDIDATES)), timeout_s=30, message="every version serving")
        time.sleep(1.0)  # one pressure poll: the gateway knows which scheduler serves which version
        try:
            yield served
        finally:
            served.channel.close()


def _state(rollouts: Mesh) -> str:
    return rollouts.saved()["state"]


def test_wrong_answers_are_caught_by_shadow_agreement_before_any_client_sees_them(rollouts):
    rollouts.roll(canary_version="2", steps=["shadow", 10, 50, 100])
    seen = rollouts.drive(lambda: _state(rollouts) != "running")
    assert _state(rollouts) == "rolled_back"
    decision = rollouts.saved()["decisions"][-1]
    assert (decision["action"], decision["from_step"]) == ("roll_back", "shadow")
    assert "agreement" in decision["evidence"] and "FAIL" in decision["evidence"]
    assert seen["2"] == 0 and seen["1"] > 0, f"no client got version 2's answer: {seen}"
    metrics = scrape(rollouts.metrics_port)
    assert metrics.value("infermesh_gateway_shadow_requests_total", model=MODEL, version="2", outcome="disagreed") > 0
    assert metrics.value("infermesh_gateway_rollout_canary_percent", model=MODEL, version="2") == 0
    assert "rollout mock-classifier canary 2: roll_back shadow" in rollouts.gateway.log_tail(200)


def test_a_three_times_slower_version_is_rolled_back_within_the_first_step(rollouts):
    rollouts.roll(canary_version="3", steps=[10, 50, 100], min_requests=200, min_duration_s=30)
    seen = rollouts.drive(lambda: _state(rollouts) != "running")
    decisions = rollouts.saved()["decisions"]
    assert [d["action"] for d in decisions] == ["start", "roll_back"], decisions
    assert decisions[-1]["from_step"] == "10%"
    assert "latency:" in decisions[-1]["evidence"]
    total = sum(seen.values())
    # Within the step's share (10 %), with room for chance on a few hundred requests.
    assert 0 < seen["3"] <= 0.1 * total + 3 * (0.1 * 0.9 * total) ** 0.5 + 2, seen


def test_a_version_failing_5_percent_is_rolled_back(rollouts):
    rollouts.roll(canary_version="4", steps=[25, 100], min_requests=400, min_duration_s=30)
    seen = rollouts.drive(lambda: _state(rollouts) != "running")
    decision = rollouts.saved()["decisions"][-1]
    assert decision["action"] == "roll_back" and "error_rate" in decision["evidence"], decision
    assert seen["INTERNAL"] > 0, seen
    metrics = scrape(rollouts.metrics_port)
    assert metrics.value("infermesh_gateway_rollout_decisions_total", model=MODEL, action="roll_back") >= 2


def test_a_version_as_good_as_the_baseline_is_promoted_through_every_step(rollouts):
    rollouts.roll(canary_version="5", steps=["shadow", 10, 50, 100],
                  checks={"latency": {"max_ratio": 1.5}, "golden": {"cases": golden_cases()}})
    seen = rollouts.drive(lambda: _state(rollouts) != "running")
    decisions = rollouts.saved()["decisions"]
    assert [(d["action"], d["to_step"]) for d in decisions] == [
        ("start", "shadow"), ("advance", "10%"), ("advance", "50%"), ("advance", "100%"), ("promote", "100%")], \
        [d["evidence"] for d in decisions]
    assert seen["5"] > 0 and set(seen) <= {"1", "5"}, seen
    image = common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes(4), height=2, width=2, channels=1))
    after = {rollouts.stub.Classify(gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name=MODEL), image=image),
                                    timeout=10).model.version for _ in range(20)}
    assert after == {"5"}, "promoted: every version-less request goes to version 5"
    assert all("golden 3/3 right" in d["evidence"] for d in decisions[1:]), "each step's golden run passed"


def test_wrong_answers_are_caught_by_the_golden_check_without_a_shadow_step(rollouts):
    rollouts.roll(canary_version="2", steps=[10, 100], min_requests=10**6, attempt=2,
                  checks={"golden": {"cases": golden_cases()}})
    rollouts.drive(lambda: _state(rollouts) != "running")
    decision = rollouts.saved()["decisions"][-1]
    assert (decision["action"], decision["from_step"]) == ("roll_back", "10%"), decision
    assert "golden 0/3 right: case 0 (image 2x2x1): top-1" in decision["evidence"], decision["evidence"]
    assert "rollout mock-classifier canary 2: golden check 0/3 right" in rollouts.gateway.log_tail(200)


def _status_rollouts(rollouts: Mesh) -> list[dict]:
    reply = admin_pb2_grpc.AdminStub(rollouts.channel).GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
    section = admin_servicer.from_proto(reply).section("rollouts")
    return section.records() if section is not None else []


def test_pause_survives_a_gateway_restart_then_abort_and_promote_by_hand(rollouts):
    held = {"canary_version": "5", "steps": [10, 100], "min_duration_s": 600, "attempt": 2}
    rollouts.roll(**held)
    rollouts.roll(**held, override="pause")
    assert _state(rollouts) == "paused"
    (row,) = _status_rollouts(rollouts)
    assert (row["state"], row["step"], row["canary_percent"]) == ("paused", "10% (1/2)", 10.0)

    rollouts.gateway.stop()
    rollouts.gateway.start().wait_serving()
    rollouts.num_reloads = 0  # a new process counts its reloads from 0
    rollouts.channel.close()
    rollouts.channel = rollouts.gateway.channel()
    rollouts.stub = gateway_pb2_grpc.InferenceStub(rollouts.channel)
    (row,) = _status_rollouts(rollouts)
    assert (row["state"], row["step"]) == ("paused", "10% (1/2)"), "the state file carried it over"
    assert "rollout mock-classifier canary 5: paused at step 10% (1/2), canary share 10%" in \
        rollouts.gateway.log_tail(200)

    rollouts.roll(**held)
    assert _state(rollouts) == "running"
    rollouts.roll(**held, override="abort")
    image = common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes(4), height=2, width=2, channels=1))
    served = {rollouts.stub.Classify(gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name=MODEL), image=image),
                                     timeout=10).model.version for _ in range(20)}
    assert served == {"1"} and _status_rollouts(rollouts)[0]["canary_percent"] == 0.0
    rollouts.roll(**held, override="promote")
    assert _status_rollouts(rollouts)[0]["canary_percent"] == 100.0
    actions = [d["action"] for d in rollouts.saved()["decisions"]]
    assert actions == ["start", "pause", "resume", "abort", "promote"], actions


def test_the_cli_pauses_aborts_resumes_and_promotes_through_the_decider(rollouts, capsys):
    held = {"canary_version": "5", "steps": [10, 100], "min_duration_s": 600, "attempt": 3}
    rollouts.roll(**held)
    # Server TLS at the gateway; the test mesh has no tenants file, so loopback callers are its admins.
    flags = ["--gateway", rollouts.gateway.address, "--ca-file", str(session_tls.session_pki().ca_path)]

    def cli_run(action: str) -> dict:
        assert cli.main(["rollout", action, MODEL, *flags, "--json"]) == 0, capsys.readouterr().err
        return json.loads(capsys.readouterr().out)

    paused = cli_run("pause")
    assert (paused["state"], paused["step"], paused["canary_percent"]) == ("paused", "10% (1/2)", 10.0)
    assert "pause" in paused["decision"] and "by hand: Admin/ControlRollout from 127.0.0.1" in paused["decision"]
    saved = rollouts.saved()
    assert (saved["state"], saved["by_rpc"]) == ("paused", True), "persisted like the file's override"
    assert cli_run("pause")["decision"] == "", "already paused: nothing changed"
    assert cli_run("abort")["canary_percent"] == 0.0
    assert _status_rollouts(rollouts)[0]["state"] == "aborted"
    assert cli_run("resume")["state"] == "running"
    assert cli_run("promote")["canary_percent"] == 100.0
    assert cli.main(["rollout", "pause", MODEL, *flags]) == 1
    assert "FAILED_PRECONDITION: cannot pause" in capsys.readouterr().err
    assert [d["action"] for d in rollouts.saved()["decisions"]] == ["start", "pause", "abort", "resume", "promote"]
