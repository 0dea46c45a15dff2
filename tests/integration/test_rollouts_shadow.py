"""Shadow traffic on real processes, beyond the classifier cases of test_rollouts.py:

  * generate: a mock-generator version 2 whose greedy tokens differ (token_shift=1) is caught by
    greedy-token agreement at the shadow step and never served; a version 3 that matches advances
    past the shadow step, its greedy golden prompts passing;
  * overload: with the primary driven past what its (slow) worker serves, mirrored calls are shed
    (outcome="shed") while the primary's requests are still served.

Decisions by counts and statistics only: each phase runs until a count is reached, never a time."""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from pathlib import Path

import pytest
import yaml

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.worker.mock_models import mock_continuation
from tests.support.closed_loop import drive_until
from tools.testbed.gateway_fixtures import scrape
from tools.testbed.processes import free_port, running_mesh, wait_until

pytestmark = pytest.mark.integration

GENERATOR, CLASSIFIER = "mock-generator", "mock-classifier"
GENERATORS = {"1": "step_ms=2", "2": "step_ms=2,token_shift=1", "3": "step_ms=2"}
# 2 items per 20 ms: about 100 requests/s, which a dozen closed-loop clients exceed.
SLOW_CLASSIFIER = "batch_ms=20,max_batch_size=2"
FAST = {"min_requests": 20, "min_duration_s": 0.3, "confidence": 0.99, "shadow_max_in_flight": 8}
MAX_IN_FLIGHT = 20
# Sheddable traffic (the shadow) is shed from 6 requests in flight at the gateway, standard from 19.
SHED_IN_FLIGHT_AT = "0.3,0.95"


def routing_text(generator: dict | None = None, classifier: dict | None = None) -> str:
    models: dict = {GENERATOR: {"default_version": "1", "versions": {"2": {}, "3": {}}},
                    CLASSIFIER: {"default_version": "1", "versions": {"2": {}}}}
    for model, rollout in ((GENERATOR, generator), (CLASSIFIER, classifier)):
        if rollout is not None:
            models[model]["rollout"] = {**FAST, **rollout}
    return yaml.safe_dump({"models": models})


class Mesh:
    def __init__(self, gateway, routing: Path, state: Path, metrics_port: int) -> None:
        self.gateway, self.routing, self.state, self.metrics_port = gateway, routing, state, metrics_port
        self.channel = gateway.channel()
        self.stub = gateway_pb2_grpc.InferenceStub(self.channel)
        self.num_reloads = 0

    def roll(self, **rollouts) -> None:
        self.num_reloads += 1
        staged = self.routing.with_suffix(".new")
        staged.write_text(routing_text(**rollouts), encoding="utf-8")
        os.replace(staged, self.routing)
        wait_until(lambda: self.metric("infermesh_gateway_config_reloads_total", file="routing",
                                       result="applied") >= self.num_reloads, timeout_s=10, message="routing reloaded")

    def saved(self, model: str) -> dict:
        return json.loads(self.state.read_text())["models"][model]

    def metric(self, name: str, **labels: str) -> float:
        return scrape(self.metrics_port).value(name, **labels)

    def generate(self, rng: random.Random) -> str:
        """One greedy version-less stream: the version that served it, or the error code."""
        prompt = "".join(rng.choice("abcdefghij") for _ in range(12))
        request = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name=GENERATOR), prompt=prompt,
                                              sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0.0))
        versions = {chunk.model.version for chunk in self.stub.Generate(request, timeout=10) if chunk.model.version}
        return ",".join(sorted(versions))

    def classify(self, rng: random.Random) -> str:
        image = common_pb2.Image(raw=common_pb2.RawImage(pixels=rng.randbytes(4), height=2, width=2, channels=1))
        reply = self.stub.Classify(gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name=CLASSIFIER),
                                                               image=image), timeout=10)
        return reply.model.version

    def drive(self, call, until, num_threads: int, timeout_s: float = 60.0) -> Counter:
        """`call(rng)` from `num_threads` threads, closed loop, until `until()`: the answers counted."""
        return drive_until(call, until, num_threads=num_threads, timeout_s=timeout_s, message="the phase's count")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rollouts-shadow")
    routing, state = tmp / "routing.yaml", tmp / "rollouts.json"
    routing.write_text(routing_text(), encoding="utf-8")
    metrics_port = free_port()
    with running_mesh(tmp) as processes:
        processes.start_scheduler()
        for version, profile in GENERATORS.items():
            processes.start_worker(GENERATOR, "--mock-profile", profile, "--model-version", version)
        for version in ("1", "2"):
            processes.start_worker(CLASSIFIER, "--mock-profile", SLOW_CLASSIFIER, "--model-version", version)
        gateway = processes.start_gateway(
            "--routing-file", str(routing), "--rollout-interval-ms", "100", "--rollout-state-file", str(state),
            "--metrics-port", str(metrics_port), "--max-in-flight", str(MAX_IN_FLIGHT),
            "--shed-in-flight-at", SHED_IN_FLIGHT_AT)
        served = Mesh(gateway, routing, state, metrics_port)
        image = common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes(4), height=2, width=2, channels=1))
        prompt = gateway_pb2.GenerateRequest(prompt="abcd", sampling=common_pb2.SamplingParams(max_tokens=2))

        def every_version_serves() -> bool:
            for version in GENERATORS:
                prompt.model.CopyFrom(common_pb2.ModelRef(name=GENERATOR, version=version))
                if not any(c.finish_reason for c in served.stub.Generate(prompt, timeout=10)):
                    return False
            return all(served.stub.Classify(gateway_pb2.ClassifyRequest(
                model=common_pb2.ModelRef(name=CLASSIFIER, version=v), image=image), timeout=10).model.version == v
                for v in ("1", "2"))

        wait_until(every_version_serves, timeout_s=30, message="every version serving")
        try:
            yield served
        finally:
            served.channel.close()


def _running(mesh: Mesh, model: str):
    return lambda: mesh.saved(model)["state"] != "running"


def test_generate_tokens_that_differ_are_caught_by_shadow_agreement_and_never_served(mesh):
    mesh.roll(generator={"canary_version": "2", "steps": ["shadow", 100]})
    seen = mesh.drive(mesh.generate, _running(mesh, GENERATOR), num_threads=4)
    saved = mesh.saved(GENERATOR)
    assert saved["state"] == "rolled_back", saved["decisions"]
    decision = saved["decisions"][-1]
    assert (decision["action"], decision["from_step"]) == ("roll_back", "shadow")
    assert "agreement 0/" in decision["evidence"] and "FAIL" in decision["evidence"], decision["evidence"]
    assert seen["1"] > 0 and not any("2" in served for served in seen), f"no stream served by version 2: {seen}"
    assert mesh.metric("infermesh_gateway_shadow_requests_total", model=GENERATOR, version="2",
                       outcome="disagreed") > 0


def test_generate_tokens_that_match_advance_through_the_shadow_step(mesh):
    golden = [{"prompt": p, "expected_ids": mock_continuation(p.encode(), 6)} for p in ("golden", "cases")]
    mesh.roll(generator={"canary_version": "3", "steps": ["shadow", 100], "checks": {"golden": {"cases": golden}}})
    # Until it leaves the shadow step: what the 100 % step decides next compares the canary with the
    # shadow step's baseline, earlier in time, which a loaded CI box may make look faster.
    seen = mesh.drive(mesh.generate, lambda: mesh.saved(GENERATOR)["step_index"] > 0 or _running(mesh, GENERATOR)(),
                      num_threads=4)
    decisions = mesh.saved(GENERATOR)["decisions"]
    assert [(d["action"], d["to_step"]) for d in decisions[:2]] == [("start", "shadow"), ("advance", "100%")], \
        [d["evidence"] for d in decisions]
    assert "agreement" in decisions[1]["evidence"] and "FAIL" not in decisions[1]["evidence"]
    assert "golden 2/2 right" in decisions[1]["evidence"], "greedy golden prompts through the real scheduler"
    assert seen["1"] > 0 and set(seen) <= {"1", "3"}, seen
    assert mesh.metric("infermesh_gateway_shadow_requests_total", model=GENERATOR, version="3",
                       outcome="disagreed") == 0


def test_shadow_calls_are_shed_first_when_the_primary_is_overloaded(mesh):
    held = {"canary_version": "2", "steps": ["shadow", 100], "min_requests": 10**6, "min_duration_s": 3600,
            "shadow_max_in_flight": 1000}  # held at the shadow step; a budget the test never fills
    mesh.roll(classifier=held)

    def shadow(outcome: str) -> float:
        return mesh.metric("infermesh_gateway_shadow_requests_total", model=CLASSIFIER, version="2", outcome=outcome)

    # Below capacity (one client): every request is mirrored, none shed.
    calm = mesh.drive(mesh.classify, lambda: shadow("agreed") >= 30, num_threads=1)
    assert shadow("shed") == 0 and calm["1"] > 0, calm

    # Past capacity (a dozen clients on a worker serving ~100/s): the mirror is shed, the primary served.
    agreed_before = shadow("agreed")
    overloaded = mesh.drive(mesh.classify, lambda: shadow("shed") >= 100, num_threads=12)
    assert overloaded["1"] > shadow("shed") / 2, f"primary requests are still served: {overloaded}"
    assert shadow("agreed") - agreed_before < shadow("shed"), "most mirrors were shed, not sent"
    assert mesh.saved(CLASSIFIER)["state"] == "running", "shedding the shadow decides nothing"
