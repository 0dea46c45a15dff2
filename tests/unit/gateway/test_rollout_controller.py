"""The rollout controller on a fake clock: steps advance on evidence, a worse canary is rolled back
at once, overrides act by hand, and the progress survives a restart and reaches a follower."""

from __future__ import annotations

import json
import logging
import random

import pytest

from services.common.errors import FailedPrecondition, NotFound
from services.gateway.rollout.controller import HandAction, RolloutController
from services.gateway.rollout.store import FileRolloutStore
from services.gateway.routing.circuit_breaker import BreakerConfig, CircuitBreakers
from services.gateway.routing.table import RoutingConfigError, RoutingTable, parse_routing_config
from tests.unit.gateway.conftest import FixedRng

POLICY = {"canary_version": "2", "steps": ["shadow", 10, 100], "min_requests": 20, "min_duration_s": 5}


def routes(**policy_over):
    policy = {**POLICY, **policy_over}
    spec = {"models": {"digits": {"default_version": "1", "endpoints": ["127.0.0.1:1"],
                                  "versions": {"2": {}}, "rollout": policy}}}
    return parse_routing_config(spec, "routing.yaml")


class Shares:
    def __init__(self) -> None:
        self.shares: dict[str, dict[str, float] | None] = {}

    def set_shares(self, model, shares):
        self.shares[model] = shares


def feed(controller, version: str, n: int, *, latency_s: float = 0.01, error_every: int = 0, seed: int = 1):
    rng = random.Random(seed)
    for i in range(n):
        code = "INTERNAL" if error_every and i % error_every == 0 else "OK"
        controller.record("digits", version, code, latency_s * (1 + rng.uniform(-0.2, 0.2)))


def shadow(controller, n: int, *, agreed: bool = True):
    for _ in range(n):
        controller.record_shadow("digits", "2", "OK", 0.01, agreed=agreed)


@pytest.fixture
def made(clock):
    shares = Shares()
    controller = RolloutController(shares, clock=clock)
    controller.apply_routes(routes())
    return controller, shares


def test_a_good_canary_is_promoted_through_every_step(made, clock):
    controller, shares = made
    assert shares.shares["digits"] == {"2": 0.0}
    assert controller.shadow_target("digits").version == "2"
    feed(controller, "1", 100)
    shadow(controller, 30)
    assert controller.tick() == [], "before the step's min_duration"
    clock.advance(5)
    (advance,) = controller.tick()
    assert (advance.action, advance.from_step, advance.to_step) == ("advance", "shadow", "10%")
    assert shares.shares["digits"] == {"2": 10.0} and controller.shadow_target("digits") is None
    feed(controller, "1", 200)
    feed(controller, "2", 25, seed=2)
    clock.advance(5)
    assert [d.to_step for d in controller.tick()] == ["100%"]
    feed(controller, "2", 25, seed=3)  # at 100% the canary is judged against the last step's baseline
    clock.advance(5)
    (promote,) = controller.tick()
    assert promote.action == "promote" and shares.shares["digits"] == {"2": 100.0}
    assert [v.state for v in controller.views()] == ["promoted"]
    assert [d.action for d in controller.decisions("digits")] == ["start", "advance", "advance", "promote"]


def test_a_failing_canary_is_rolled_back_at_once_and_held(made, clock, caplog):
    controller, shares = made
    feed(controller, "1", 50)
    shadow(controller, 20)
    clock.advance(5)
    controller.tick()
    feed(controller, "1", 500)
    feed(controller, "2", 12, error_every=2, seed=2)  # before min_requests: evidence is enough
    with caplog.at_level(logging.WARNING, logger="services.gateway.rollout.controller"):
        (decision,) = controller.tick()
    assert decision.action == "roll_back" and "error_rate" in decision.evidence and "FAIL" in decision.evidence
    assert shares.shares["digits"] == {"2": 0.0}
    assert "rollout digits canary 2: roll_back 10% (canary n=12" in caplog.text
    feed(controller, "2", 100)
    clock.advance(60)
    assert controller.tick() == [], "held: nothing more is decided"
    assert controller.views()[0].state == "rolled_back"


def test_shadow_disagreement_rolls_back_before_any_client_sees_the_canary(made, clock):
    controller, shares = made
    feed(controller, "1", 50)
    shadow(controller, 10, agreed=False)
    (decision,) = controller.tick()
    assert decision.action == "roll_back" and decision.from_step == "shadow"
    assert "agreement 0/10" in decision.evidence
    assert shares.shares["digits"] == {"2": 0.0}


def test_overrides_pause_resume_abort_and_promote_by_hand(made, clock):
    controller, shares = made
    controller.apply_routes(routes(override="pause"))
    assert controller.views()[0].state == "paused"
    shadow(controller, 50)
    clock.advance(10)
    assert controller.tick() == [], "paused: nothing is decided"
    controller.apply_routes(routes())
    assert controller.views()[0].state == "running"
    assert controller.views()[0].num_canary == 0, "resumed: the step gathers its evidence again"
    controller.apply_routes(routes(override="promote"))
    assert shares.shares["digits"] == {"2": 100.0}
    controller.apply_routes(routes(override="abort"))
    assert shares.shares["digits"] == {"2": 0.0}
    assert [d.action for d in controller.decisions("digits")] == ["start", "pause", "resume", "promote", "abort"]


def test_a_new_attempt_starts_over_and_a_dropped_policy_returns_the_share_to_the_file(made, clock):
    controller, shares = made
    shadow(controller, 10, agreed=False)
    feed(controller, "1", 20)
    controller.tick()
    controller.apply_routes(routes(attempt=2))
    assert controller.views()[0].state == "running" and controller.views()[0].step == "shadow"
    plain = parse_routing_config({"models": {"digits": {"default_version": "1", "endpoints": ["127.0.0.1:1"]}}}, "r")
    controller.apply_routes(plain)
    assert shares.shares["digits"] is None and controller.views() == []


def test_progress_survives_a_restart_and_reaches_a_follower(tmp_path, clock):
    store = FileRolloutStore(tmp_path / "rollouts.json")
    first = RolloutController(Shares(), store, clock=clock)
    first.apply_routes(routes())
    shadow(first, 30)
    feed(first, "1", 30)
    clock.advance(5)
    first.tick()
    follower_shares = Shares()
    follower = RolloutController(follower_shares, FileRolloutStore(tmp_path / "rollouts.json"), decider=False,
                                 clock=clock)
    follower.apply_routes(routes())
    assert follower_shares.shares["digits"] == {"2": 10.0}, "the follower starts where the decider is"
    clock.advance(3)
    restarted_shares = Shares()
    restarted = RolloutController(restarted_shares, store, clock=clock)
    restarted.apply_routes(routes())
    assert restarted_shares.shares["digits"] == {"2": 10.0}
    feed(restarted, "1", 200)
    feed(restarted, "2", 25, seed=4)
    clock.advance(2)  # 5 s since the step began, counting the time before the restart
    assert [d.to_step for d in restarted.tick()] == ["100%"]
    follower.tick()
    assert follower_shares.shares["digits"] == {"2": 100.0}
    saved = json.loads((tmp_path / "rollouts.json").read_text())
    assert saved["models"]["digits"]["step_index"] == 2


def test_a_broken_state_file_is_logged_and_read_as_empty(tmp_path, clock, caplog):
    path = tmp_path / "rollouts.json"
    path.write_text("{not json")
    with caplog.at_level(logging.ERROR):
        controller = RolloutController(Shares(), FileRolloutStore(path), clock=clock)
    assert "not JSON" in caplog.text
    path.write_text(json.dumps({"models": {"digits": {"state": "sideways"}}}))
    with caplog.at_level(logging.ERROR):
        controller = RolloutController(Shares(), FileRolloutStore(path), clock=clock)
    assert "ignoring the record of model 'digits'" in caplog.text
    controller.apply_routes(routes())
    assert controller.views()[0].step == "shadow"


def test_routing_table_draws_versions_by_the_controllers_shares(clock):
    table = RoutingTable(routes(), CircuitBreakers(BreakerConfig(), clock), rng=FixedRng(0.05, 0.5, 0.05, 0.5, 0.5, 0.5))
    assert table.choose("digits").version == "1", "no shares set: the file's canary_percent (0)"
    table.set_shares("digits", {"2": 10.0})
    assert [table.choose("digits").version for _ in range(2)] == ["2", "1"]
    assert table.shares("digits") == {"2": 10.0}
    table.set_shares("digits", None)
    assert table.shares("digits") == {}


def test_a_bad_rollout_in_the_routing_file_names_file_model_and_field():
    with pytest.raises(RoutingConfigError) as raised:
        routes(canary_version="9")
    assert str(raised.value) == ("routing.yaml: model 'digits': field 'rollout.canary_version': "
                                 "'9' is not listed under versions")


# --------------------------------------------------------------------------- by RPC (Admin/ControlRollout)


def test_pause_resume_abort_and_promote_by_rpc_are_decisions_saved_in_the_state_file(tmp_path, clock):
    store = FileRolloutStore(tmp_path / "rollouts.json")
    shares = Shares()
    controller = RolloutController(shares, store, clock=clock)
    controller.apply_routes(routes())
    decision, view = controller.control("digits", HandAction.PAUSE, "by hand: ops")
    assert (decision.action, decision.evidence, view.state) == ("pause", "by hand: ops", "paused")
    saved = json.loads((tmp_path / "rollouts.json").read_text())["models"]["digits"]
    assert (saved["state"], saved["by_hand"], saved["by_rpc"]) == ("paused", True, True)
    shadow(controller, 50)
    clock.advance(10)
    assert controller.tick() == [], "paused: nothing is decided"
    assert controller.control("digits", HandAction.PAUSE)[0] is None, "already paused: nothing to do"
    assert controller.control("digits", HandAction.RESUME)[1].state == "running"
    assert controller.control("digits", HandAction.PROMOTE)[1].canary_percent == 100.0
    assert shares.shares["digits"] == {"2": 100.0}
    assert controller.control("digits", HandAction.ABORT)[1].canary_percent == 0.0
    assert [d.action for d in controller.decisions("digits")] == ["start", "pause", "resume", "promote", "abort"]
    restarted = RolloutController(Shares(), store, clock=clock)
    restarted.apply_routes(routes())
    assert restarted.views()[0].state == "aborted", "an RPC's state survives a restart"


def test_a_state_set_by_rpc_survives_reloads_of_a_file_without_override_but_the_file_wins_while_it_has_one(
        made, clock):
    controller, shares = made
    controller.control("digits", HandAction.PAUSE)
    controller.apply_routes(routes())
    assert controller.views()[0].state == "paused", "a reload without an override keeps what the RPC set"
    controller.apply_routes(routes(override="pause"))
    with pytest.raises(FailedPrecondition, match="routing file's override 'pause'"):
        controller.control("digits", HandAction.RESUME)
    controller.apply_routes(routes())
    assert controller.views()[0].state == "running", "the file took the pause over, so removing it resumes"


def test_moves_the_state_does_not_allow_name_the_state(made, clock):
    controller, _ = made
    assert controller.control("digits", HandAction.RESUME)[0] is None, "running already: nothing to do"
    feed(controller, "1", 50)
    shadow(controller, 10, agreed=False)
    controller.tick()
    assert controller.views()[0].state == "rolled_back"
    with pytest.raises(FailedPrecondition, match="cannot pause digits's rollout: it is rolled_back.*attempt"):
        controller.control("digits", HandAction.PAUSE)
    with pytest.raises(FailedPrecondition, match="cannot resume digits's rollout: it is rolled_back by the analysis"):
        controller.control("digits", HandAction.RESUME)
    with pytest.raises(NotFound, match="'mnist' has no rollout policy"):
        controller.control("mnist", HandAction.PAUSE)


def test_a_follower_refuses_by_rpc_naming_the_decider_role(tmp_path, clock):
    follower = RolloutController(Shares(), FileRolloutStore(tmp_path / "rollouts.json"), decider=False, clock=clock)
    follower.apply_routes(routes())
    with pytest.raises(FailedPrecondition, match="rollout follower.*--rollout-role is decider"):
        follower.control("digits", HandAction.ABORT)


def test_a_restarted_decider_keeps_the_steps_timer_and_gathers_its_minimum_again(tmp_path, clock):
    """The chosen behaviour (docs/operations.md, "State and replicas"): a step's samples live in the
    decider's memory; after a restart the step needs min_requests new canary requests, judged
    together, but not its min_duration again."""
    store = FileRolloutStore(tmp_path / "rollouts.json")
    first = RolloutController(Shares(), store, clock=clock)
    first.apply_routes(routes(steps=[10, 100]))
    feed(first, "1", 200)
    feed(first, "2", 19, seed=2)  # one short of min_requests
    clock.advance(5)
    assert first.tick() == [] and first.views()[0].num_canary == 19

    restarted = RolloutController(Shares(), store, clock=clock)
    restarted.apply_routes(routes(steps=[10, 100]))
    (view,) = restarted.views()
    assert (view.step, view.num_canary, view.num_baseline) == ("10%", 0, 0), "the samples did not survive"
    feed(restarted, "1", 200)
    feed(restarted, "2", 1, seed=3)
    assert restarted.tick() == [], "one new canary request is not the step's minimum"
    feed(restarted, "2", 19, seed=4)
    (advance,) = restarted.tick()  # no clock advance: the step's 5 s were served before the restart
    assert advance.to_step == "100%" and "canary n=20" in advance.evidence
