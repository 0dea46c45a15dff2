"""Golden checks in a rollout: the policy's cases parse (inline, or a manifest's), answers compare
exactly, and the controller runs them at every step's start and every interval, rolls back on a
wrong answer, and advances no step before a run of them passed in it."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest

from services.gateway.rollout.controller import GOLDEN_RETRY_S, RolloutController
from services.gateway.rollout.golden import CaseAnswer, GoldenImage, GoldenPrompt, compare
from services.gateway.routing.table import RoutingConfigError, parse_routing_config
from services.gateway.telemetry import metrics
from tests.unit.gateway.test_rollout_controller import Shares, feed, shadow

PIXELS = base64.b64encode(bytes([1, 2, 3, 4])).decode()
IMAGE = {"height": 2, "width": 2, "channels": 1, "pixels_b64": PIXELS, "expected_top1": 3}
POLICY = {"canary_version": "2", "steps": ["shadow", 10, 100], "min_requests": 20, "min_duration_s": 5,
          "checks": {"golden": {"cases": [IMAGE, {**IMAGE, "expected_top1": 5}], "interval_s": 10}}}


def routes(**policy_over):
    spec = {"models": {"digits": {"default_version": "1", "endpoints": ["127.0.0.1:1"],
                                  "versions": {"2": {}}, "rollout": {**POLICY, **policy_over}}}}
    return parse_routing_config(spec, "routing.yaml")


def policy_of(**over):
    (route,) = routes(**over)
    return route.rollout


RIGHT = [CaseAnswer(top1=3), CaseAnswer(top1=5)]


@pytest.fixture
def made(clock):
    shares = Shares()
    controller = RolloutController(shares, clock=clock)
    controller.apply_routes(routes())
    return controller, shares


def test_cases_parse_inline_and_from_a_manifest_and_change_the_rollouts_identity(tmp_path):
    golden = policy_of().checks.golden
    assert golden.cases == (GoldenImage(2, 2, 1, bytes([1, 2, 3, 4]), 3), GoldenImage(2, 2, 1, bytes([1, 2, 3, 4]), 5))
    assert golden.interval_s == 10
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"kind": "generator", "generator": {
        "golden": [{"prompt_ids": [257, *b"abc"], "expected_ids": [100, 101]}]}}))  # BOS first, as tinylm's
    from_file = policy_of(checks={"golden": {"file": str(manifest)}}).checks.golden
    assert from_file.cases == (GoldenPrompt("abc", (100, 101)),) and from_file.interval_s == 30
    assert policy_of().rollout_id != policy_of(checks={"golden": {"cases": [IMAGE]}}).rollout_id
    assert "golden" not in policy_of(checks={}).rollout_id, "no cases: the check is off, the identity as before"
    assert policy_of(checks={"golden": False}).checks.golden is None


@pytest.mark.parametrize(("golden", "message"), [
    ({}, "field 'rollout.checks.golden': has no cases: give cases or file"),
    (True, "field 'rollout.checks.golden': must be a mapping"),
    ({"cases": [{**IMAGE, "pixels_b64": "AQI="}]}, "rollout.checks.golden.cases[0].pixels_b64': holds 2 bytes"),
    ({"cases": [{"prompt": "hi"}]}, "cases[0]': needs expected_top1 (an image case) or expected_ids"),
    ({"cases": [{"prompt": "hi", "prompt_ids": [1], "expected_ids": [1]}]}, "needs one of prompt"),
    ({"cases": [IMAGE, {"prompt": "hi", "expected_ids": [1]}]}, "mixes image and prompt cases"),
    ({"cases": [IMAGE], "interval_s": 0.1}, "interval_s': must be a number of seconds >= 1"),
    ({"cases": [{"prompt_ids": [257, 300], "expected_ids": [1]}]}, "prompt_ids': must be the UTF-8 bytes"),
    ({"cases": [{"prompt_ids": [257], "expected_ids": [1]}]}, "prompt_ids': holds no text after the BOS"),
    ({"file": "relative.json"}, "golden.file': must be an absolute path"),
    ({"file": "/nonexistent/manifest.json"}, "golden.file': cannot read /nonexistent/manifest.json"),
    ({"cases": [IMAGE], "every": 3}, "golden.every': unknown field (expected cases, file, interval_s)"),
])
def test_bad_golden_settings_name_the_field(golden, message):
    with pytest.raises(RoutingConfigError, match="routing.yaml: model 'digits': field") as caught:
        routes(checks={"golden": golden})
    assert message in str(caught.value)


def test_answers_compare_exactly_and_only_wrong_answers_count_against_the_canary():
    cases = (GoldenImage(1, 1, 1, b"\0", 3), GoldenPrompt("hi", (7, 8, 9)), GoldenImage(1, 1, 1, b"\0", 4))
    right = compare(cases, [CaseAnswer(top1=3), CaseAnswer(token_ids=(7, 8, 9)), CaseAnswer(top1=4)])
    assert (right.num_passed, right.mismatches, right.complete) == (3, (), True)
    wrong = compare(cases, [CaseAnswer(top1=2), CaseAnswer(token_ids=(7, 1)), CaseAnswer(code="UNAVAILABLE")])
    assert wrong.mismatches == ("case 0 (image 1x1x1): top-1 2, expected 3",
                                "case 1 (prompt 'hi'): tokens differ from position 1 (2 tokens, expected 3)")
    assert wrong.complete, "a wrong answer decides, whatever else went unanswered"
    shed = compare(cases[:1], [CaseAnswer(code="RESOURCE_EXHAUSTED", message="shed")])
    assert (shed.num_unanswered, shed.complete) == (1, False)
    failed = compare(cases[:1], [CaseAnswer(code="INTERNAL", message="boom")])
    assert failed.mismatches == ("case 0 (image 1x1x1): INTERNAL: boom",)


def test_no_step_advances_before_its_golden_run_passed(made, clock):
    controller, shares = made
    (target,) = controller.golden_due()
    assert (target.model, target.version, len(target.cases)) == ("digits", "2", 2)
    assert controller.golden_due() == [], "one run in flight at a time"
    feed(controller, "1", 100)
    shadow(controller, 30)
    clock.advance(5)
    assert controller.tick() == [], "minimums met, but the golden run has not answered"
    assert "golden not run yet in this step vs 2 cases" in controller.views()[0].judgement
    controller.golden_done(target, RIGHT)
    (advance,) = controller.tick()
    assert advance.to_step == "10%" and "golden 2/2 right vs 2 cases" in advance.evidence
    (again,) = controller.golden_due()
    assert again.run_id != target.run_id, "every step runs the cases again at its start"
    assert controller.golden_done(target, RIGHT) is None, "a run of the step before is dropped"
    feed(controller, "1", 200)
    feed(controller, "2", 25, seed=2)
    clock.advance(5)
    assert controller.tick() == []
    controller.golden_done(again, RIGHT)
    assert [d.to_step for d in controller.tick()] == ["100%"]


def test_a_wrong_golden_answer_rolls_back_at_once(made, clock):
    controller, shares = made
    (target,) = controller.golden_due()
    controller.golden_done(target, [CaseAnswer(top1=3), CaseAnswer(top1=4)])
    (decision,) = controller.tick()
    assert (decision.action, decision.from_step) == ("roll_back", "shadow")
    assert "golden 1/2 right: case 1 (image 2x2x1): top-1 4, expected 5 vs 2 cases FAIL" in decision.evidence
    assert shares.shares["digits"] == {"2": 0.0}
    assert controller.golden_due() == [], "a rolled-back rollout runs no more cases"


def test_golden_runs_repeat_every_interval_and_an_unanswered_run_is_tried_again_soon(made, clock):
    controller, _ = made
    (first,) = controller.golden_due()
    controller.golden_done(first, [CaseAnswer(top1=3), CaseAnswer(code="RESOURCE_EXHAUSTED", message="shed")])
    assert controller.golden_due() == []
    clock.advance(GOLDEN_RETRY_S)
    (retry,) = controller.golden_due()
    controller.golden_done(retry, RIGHT)
    clock.advance(9)
    assert controller.golden_due() == []
    clock.advance(1)
    (periodic,) = controller.golden_due()
    controller.golden_done(periodic, [CaseAnswer(top1=0), CaseAnswer(top1=5)])
    (decision,) = controller.tick()
    assert decision.action == "roll_back", "a later run's wrong answer rolls back as well"


def test_a_follower_runs_no_golden_cases(tmp_path, clock):
    follower = RolloutController(Shares(), decider=False, clock=clock)
    follower.apply_routes(routes())
    assert follower.golden_due() == []


def test_the_run_loop_sends_the_cases_through_the_prober_and_judges_the_answers(clock):
    class Prober:
        def __init__(self) -> None:
            self.calls: list[tuple[str, str, int]] = []

        async def answers(self, model, version, cases):
            self.calls.append((model, version, len(cases)))
            return [CaseAnswer(top1=9) for _ in cases]

    async def main():
        controller = RolloutController(Shares(), clock=clock)
        controller.apply_routes(routes())
        controller.prober = Prober()
        loop = asyncio.create_task(controller.run(0.001))
        try:
            while controller.views()[0].state == "running":
                await asyncio.sleep(0.001)
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
        return controller

    controller = asyncio.run(asyncio.wait_for(main(), 5))
    assert controller.prober.calls[0] == ("digits", "2", 2)
    assert controller.decisions("digits")[-1].action == "roll_back"


def test_a_step_rolled_back_at_its_first_tick_still_runs_its_golden_cases(clock, caplog):
    # Shadow disagreement is decisive on a few requests: the first tick already rolls back. The golden
    # run due at the step's start goes out before that judgement, so its answers are still reported.
    class Prober:
        def __init__(self) -> None:
            self.calls = 0

        async def answers(self, model, version, cases):
            self.calls += 1
            return RIGHT

    async def main():
        controller = RolloutController(Shares(), clock=clock)
        controller.apply_routes(routes())
        controller.prober = Prober()
        feed(controller, "1", 30)
        shadow(controller, 20, agreed=False)
        loop = asyncio.create_task(controller.run(0.001))
        try:
            while not any("golden check" in record.getMessage() for record in caplog.records):
                await asyncio.sleep(0.001)
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
        return controller

    with caplog.at_level("INFO", logger="services.gateway.rollout.controller"):
        controller = asyncio.run(asyncio.wait_for(main(), 5))
    (roll_back,) = [d for d in controller.decisions("digits") if d.action == "roll_back"]
    assert "golden not run yet in this step" in roll_back.evidence, "the judgement did not wait for the cases"
    assert controller.prober.calls == 1
    assert any("canary 2: golden check 2/2 right" in record.getMessage() for record in caplog.records)


def test_the_prober_sends_each_case_pinned_sheddable_and_as_its_own_tenant(clock):
    from services.gateway.rollout.probe import GOLDEN_TENANT, RoutedGoldenProber
    from services.gateway.routing.circuit_breaker import BreakerConfig, CircuitBreakers
    from services.gateway.routing.table import RoutingTable
    from services.gateway.upstream.status import UpstreamCode
    from tests.unit.gateway.test_shadow import FakeScheduler, label

    routing = RoutingTable(routes(), CircuitBreakers(BreakerConfig(), clock))
    scheduler = FakeScheduler(labels=[label("three")], tokens=(7, 1, 9, 9))
    scheduler.labels[0].index = 3
    admits = {"now": True}
    prober = RoutedGoldenProber(routing, scheduler, admits_sheddable=lambda model: admits["now"], timeout_s=1.0)
    cases = (GoldenImage(2, 2, 1, bytes(4), 3), GoldenPrompt("hi", (7, 8, 9)))

    answers = asyncio.run(prober.answers("digits", "2", cases))
    assert answers == [CaseAnswer(top1=3), CaseAnswer(token_ids=(7, 1))], "the stream stops at the divergence"
    assert scheduler.calls[0].cancelled
    classify_request, generate_request = scheduler.requests
    assert classify_request.request.model.version == generate_request.request.model.version == "2"
    assert classify_request.tenant.tenant_id == GOLDEN_TENANT
    assert classify_request.tenant.priority == 3  # PRIORITY_SHEDDABLE
    assert generate_request.request.sampling.temperature == 0 and generate_request.request.sampling.max_tokens == 3

    admits["now"] = False
    (shed,) = asyncio.run(prober.answers("digits", "2", cases[:1]))
    assert shed.code == "RESOURCE_EXHAUSTED" and len(scheduler.requests) == 2, "shed: not sent"
    admits["now"] = True
    scheduler.fail = UpstreamCode.INTERNAL
    (failed,) = asyncio.run(prober.answers("digits", "2", cases[:1]))
    assert failed.code == "INTERNAL"
    (unknown,) = asyncio.run(prober.answers("digits", "9", cases[:1]))
    assert unknown.code == "NOT_FOUND", "a version the routing file does not list: unanswered, not wrong"


def test_each_golden_run_is_counted_by_outcome(made, clock):
    controller, _ = made

    def count(outcome: str) -> float:
        return metrics.GOLDEN_RUNS.labels("digits", "2", outcome)._value.get()

    before = {o: count(o) for o in ("passed", "failed", "incomplete")}
    (first,) = controller.golden_due()
    controller.golden_done(first, [CaseAnswer(top1=3), CaseAnswer(code="UNAVAILABLE", message="no worker")])
    clock.advance(GOLDEN_RETRY_S)
    (retry,) = controller.golden_due()
    controller.golden_done(retry, RIGHT)
    clock.advance(10)
    (periodic,) = controller.golden_due()
    controller.golden_done(periodic, [CaseAnswer(top1=0), CaseAnswer(top1=5)])
    assert {o: count(o) - before[o] for o in before} == {"passed": 1, "failed": 1, "incomplete": 1}
