"""Admission's correction of the predicted TTFT by what its streams measured (admission/ttft_calibration.py), alone
and through Admission: a class whose streams start later than predicted has its next predictions raised, one
that starts sooner lowered, and the correction fades while no stream reports."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from infermesh.v1 import common_pb2, gateway_pb2
from services.common.errors import ResourceExhausted
from services.common.objectives import NO_OVERRIDE
from services.common.priority import Priority
from services.gateway.admission.adaptive_limit import AdaptiveLimits
from services.gateway.admission.admission import Admission, AdmissionParts, OpenTenants
from services.gateway.admission.concurrency import ConcurrencyLimiter
from services.gateway.admission.shedding import LoadShedder
from services.gateway.admission.ttft_calibration import MAX_FACTOR, MAX_WEIGHT, MIN_FACTOR, TtftCalibration
from services.gateway.calls.generate_core import GenerateCore
from services.gateway.config import GatewayConfig
from services.gateway.dispatch.deadlines import Deadlines
from services.gateway.dispatch.dispatcher import _ttft_target_s
from services.gateway.routing.pressure import PressureBoard, PressureReport

BATCH = Priority.SHEDDABLE


def _learn(calibration: TtftCalibration, predicted_s: float, measured_s: float, now_s: float = 0.0,
           times: int = 1, **over) -> None:
    for _ in range(times):
        calibration.observe("gen", BATCH, predicted_s=predicted_s, measured_s=measured_s, target_s=5.0, now_s=now_s,
                            **over)


def test_nothing_learned_is_no_correction():
    assert TtftCalibration().factor("gen", BATCH, 0.0) == 1.0


def test_streams_slower_than_predicted_raise_the_factor_toward_their_ratio():
    calibration = TtftCalibration()
    _learn(calibration, 1.0, 3.0)
    assert calibration.factor("gen", BATCH, 0.0) == pytest.approx(math.sqrt(3.0)), "one stream: halfway (in logs)"
    _learn(calibration, 1.0, 3.0, times=40)
    # The newest MAX_WEIGHT streams against the one pseudo-stream that measured its prediction.
    assert calibration.factor("gen", BATCH, 0.0) == pytest.approx(3.0 ** (MAX_WEIGHT / (MAX_WEIGHT + 1)))
    assert calibration.factor("gen", Priority.CRITICAL, 0.0) == 1.0, "per class"
    assert calibration.factor("other", BATCH, 0.0) == 1.0, "per model"


def test_ratios_average_in_logs_so_twice_as_slow_and_twice_as_fast_cancel():
    calibration = TtftCalibration()
    for _ in range(40):
        _learn(calibration, 1.0, 2.0)
        _learn(calibration, 1.0, 0.5)
    assert 0.95 < calibration.factor("gen", BATCH, 0.0) < 1.05


def test_a_quantile_adds_the_spread_of_the_ratios_to_their_mean():
    spread = TtftCalibration()
    for _ in range(40):
        _learn(spread, 1.0, 2.0)
        _learn(spread, 1.0, 0.5)
    median = spread.factor("gen", BATCH, 0.0)
    # A log-normal's 90th percentile: exp(mean + 1.28 sd), sd ~ ln 2 (shrunk by the prior's weight).
    assert spread.factor("gen", BATCH, 0.0, 0.9) == pytest.approx(
        median * math.exp(1.2816 * math.log(2.0) * math.sqrt(MAX_WEIGHT / (MAX_WEIGHT + 1))), rel=0.02)
    assert spread.factor("gen", BATCH, 0.0, 0.1) < median < spread.factor("gen", BATCH, 0.0, 0.9)
    steady = TtftCalibration()
    _learn(steady, 1.0, 3.0, times=40)
    assert steady.factor("gen", BATCH, 0.0, 0.9) == pytest.approx(steady.factor("gen", BATCH, 0.0)), "no spread"
    assert TtftCalibration().factor("gen", BATCH, 0.0, 0.99) == 1.0, "nothing learned: no margin either"
    with pytest.raises(ValueError, match="quantile must be in"):
        spread.factor("gen", BATCH, 0.0, 1.0)


def test_the_newest_streams_outweigh_the_old():
    calibration = TtftCalibration()
    _learn(calibration, 1.0, 0.5, times=100)
    _learn(calibration, 1.0, 2.0, times=2 * round(MAX_WEIGHT))
    assert calibration.factor("gen", BATCH, 0.0) > 1.5, "from 0.5x to over 1.5x in two windows of streams"


def test_the_factor_is_held_within_its_bounds():
    calibration = TtftCalibration()
    _learn(calibration, 0.1, 100.0, times=5)
    assert calibration.factor("gen", BATCH, 0.0) == pytest.approx(MAX_FACTOR)
    _learn(calibration, 100.0, 0.1, times=50)
    assert calibration.factor("gen", BATCH, 0.0) == pytest.approx(MIN_FACTOR)


def test_tiny_times_are_floored_so_timer_ticks_teach_nothing():
    calibration = TtftCalibration()
    _learn(calibration, 0.0001, 0.004, times=5)  # both under the 5 ms floor: a ratio of 1
    assert calibration.factor("gen", BATCH, 0.0) == pytest.approx(1.0)


def test_the_factor_fades_while_no_stream_reports():
    """A class refused whole sends no samples: each stream's weight halves per half-life, the longer of
    HALF_LIFE_S and its target (samples come back a TTFT after their admission), and the prior takes over."""
    calibration = TtftCalibration(half_life_s=2.0)
    _learn(calibration, 1.0, 4.0, now_s=100.0, times=40)  # target 5 s: half-life 5 s

    def expected(weight: float) -> float:
        return 4.0 ** (weight / (weight + 1))

    assert calibration.factor("gen", BATCH, 100.0) == pytest.approx(expected(MAX_WEIGHT))
    assert calibration.factor("gen", BATCH, 105.0) == pytest.approx(expected(MAX_WEIGHT / 2))
    assert calibration.factor("gen", BATCH, 130.0) == pytest.approx(expected(MAX_WEIGHT / 64))
    assert calibration.factor("gen", BATCH, 130.0) < 1.5
    assert calibration.factor("gen", BATCH, 99.0) == pytest.approx(expected(MAX_WEIGHT)), "a clock read before"


def test_a_stream_that_ended_without_a_first_token_teaches_only_a_wait_past_the_prediction():
    calibration = TtftCalibration()
    _learn(calibration, 1.0, 0.2, censored=True)  # ended (cancelled, failed) early: its TTFT is unknown
    assert calibration.factor("gen", BATCH, 0.0) == 1.0
    _learn(calibration, 1.0, 3.0, censored=True)  # waited 3 s for a 1 s prediction: at least 3x
    assert calibration.factor("gen", BATCH, 0.0) == pytest.approx(math.sqrt(3.0))


def test_bad_times_are_ignored():
    calibration = TtftCalibration()
    _learn(calibration, float("nan"), 1.0)
    _learn(calibration, 1.0, float("inf"))
    _learn(calibration, -1.0, 1.0)
    assert calibration.factor("gen", BATCH, 0.0) == 1.0


@pytest.mark.parametrize("half_life_s, max_weight", [(0.0, 20.0), (1.0, 0.5)])
def test_settings_out_of_range_are_refused(half_life_s, max_weight):
    with pytest.raises(ValueError):
        TtftCalibration(half_life_s=half_life_s, max_weight=max_weight)


# -- through Admission --------------------------------------------------------------------------------------

def _admission(clock, *, calibrate: bool = True, quantile: float = 0.9) -> tuple[Admission, PressureBoard]:
    config = GatewayConfig(allow_anonymous=True, slo_ttft_ms=(200.0, 1000.0, 5000.0))
    board = PressureBoard(clock)
    parts = AdmissionParts(
        limiter=ConcurrencyLimiter(100), tenants=OpenTenants(),
        routing=SimpleNamespace(model=lambda name: None),  # type: ignore[arg-type]
        deadlines=Deadlines(config.deadline_policy(), clock), board=board,
        shedder=LoadShedder(config.shedding_config(), board), limits=AdaptiveLimits(config.limit_config(), clock),
        quotas=None, model_label=lambda model: model, objectives=config.objective_policy(),
        ttft_calibration=calibrate, ttft_admit_quantile=quantile)
    return Admission(parts, clock), board


def _batch_report(predicted_ms: float, queue_depth: int = 16, ns_per_prompt_token: int = 0) -> PressureReport:
    """A scheduler predicting `predicted_ms` for a one-token batch stream, each more prompt token adding
    `ns_per_prompt_token`; `queue_depth` streams wait there (0: a new stream would start on the next steps, and
    admission then judges no miss as overload)."""
    us = [0, 0, 0, round(predicted_ms * 1000)]
    return PressureReport.from_fields("gen", [0, 0, 0, 0], queue_depth, 0.0, 1, 10_000, 8, us, 5_000, [0, 0, 0, 0],
                                      ns_per_prompt_token)


def _burst(admission: Admission, clock, num: int, ttft_s: float | None) -> list:
    """Admits `num` batch streams at once (raises if one is refused); they start after `ttft_s`, or end without a
    token after 10 s (None). Returns their scopes."""
    scopes = []
    for _ in range(num):
        scope = admission.scope("Generate", "gen")
        admission.admit(scope, None, 30.0, priority=BATCH, objective=lambda: NO_OVERRIDE)
        scopes.append(scope)
    clock.advance(10.0 if ttft_s is None else ttft_s)
    for scope in scopes:
        if ttft_s is not None:
            scope.tokens_sent(1)
        scope.finish("OK" if ttft_s is not None else "DEADLINE_EXCEEDED")
    return scopes


def test_admission_learns_that_its_streams_start_later_than_predicted_and_refuses_the_next_miss(clock):
    admission, board = _admission(clock)
    board.update("a:1", [_batch_report(1000.0)])
    first = _burst(admission, clock, 1, 3.0)[0]
    assert first.predicted_ttft_s == pytest.approx(1.0), "nothing learned yet: the board's prediction"
    board.update("a:1", [_batch_report(1000.0)])  # each poll: the board's count of admissions restarts
    _burst(admission, clock, 20, 3.0)
    board.update("a:1", [_batch_report(1500.0)])
    corrected = _burst(admission, clock, 1, 3.0)[0]
    assert corrected.ttft_correction > 2.5 and corrected.predicted_ttft_s == pytest.approx(
        1.5 * corrected.ttft_correction)
    # Routing judges each replica's own prediction against the target over the same correction.
    assert _ttft_target_s(corrected) == pytest.approx(5.0 / corrected.ttft_correction)
    board.update("a:1", [_batch_report(2000.0)])  # 2 s, ~3x as these ran: past the 5 s target
    with pytest.raises(ResourceExhausted, match="past its TTFT target 5000 ms"):
        _burst(admission, clock, 1, 1.0)
    without, plain_board = _admission(clock, calibrate=False)
    plain_board.update("a:1", [_batch_report(2000.0)])
    assert _burst(without, clock, 1, 1.0)[0].predicted_ttft_s == pytest.approx(2.0), "off: the board's prediction"


def test_admission_lowers_a_prediction_its_streams_beat_and_learns_from_streams_that_never_started(clock):
    admission, board = _admission(clock)
    board.update("a:1", [_batch_report(4000.0)])
    _burst(admission, clock, 20, 1.0)
    board.update("a:1", [_batch_report(6000.0)])  # 6 s read as ~1.6 s: admitted
    assert _burst(admission, clock, 1, 1.0)[0].predicted_ttft_s < 2.5
    board.update("a:1", [_batch_report(400.0)])
    _burst(admission, clock, 20, None)  # admitted on ~0.1 s, waited 10 s and got nothing: at least 25x
    board.update("a:1", [_batch_report(1500.0)])
    with pytest.raises(ResourceExhausted):
        _burst(admission, clock, 1, 1.0)


def test_admission_judges_a_quantile_of_the_prediction_and_reports_its_median(clock):
    """Streams that start anywhere from half to twice their prediction: a 3.5 s median prediction of a 5 s target
    misses one time in four or so; judged on its 90th percentile it is refused, on its median admitted."""
    def taught(quantile: float) -> Admission:
        admission, board = _admission(clock, quantile=quantile)
        for _ in range(10):
            board.update("a:1", [_batch_report(1000.0)])
            _burst(admission, clock, 1, 2.0)
            board.update("a:1", [_batch_report(1000.0)])
            _burst(admission, clock, 1, 0.5)
        board.update("a:1", [_batch_report(3500.0)])
        return admission

    with pytest.raises(ResourceExhausted, match="past its TTFT target 5000 ms"):
        _burst(taught(0.9), clock, 1, 1.0)
    admitted = _burst(taught(0.5), clock, 1, 1.0)[0]
    assert admitted.predicted_ttft_s == pytest.approx(3.5, rel=0.1), "the median"


def test_time_no_scheduler_could_take_a_stream_teaches_nothing(clock):
    """Held through an outage (the dispatcher's unserved()/attempt() on its limit permit), a stream's first token
    comes seconds late: that is no news of how fast the schedulers start one (test_all_schedulers_unavailable:
    taught as such, every prediction read up to 4x for seconds after the schedulers were back)."""
    admission, board = _admission(clock)
    for _ in range(20):
        board.update("a:1", [_batch_report(1000.0)])
        scope = admission.scope("Generate", "gen")
        admission.admit(scope, None, 30.0, priority=BATCH, objective=lambda: NO_OVERRIDE)
        scope.model_permit.attempt()
        clock.advance(0.1)
        scope.model_permit.unserved(from_attempt=True)  # its scheduler died under it
        clock.advance(9.0)  # held, no scheduler anywhere
        scope.model_permit.attempt()  # one is back
        clock.advance(1.0)
        scope.tokens_sent(1)  # 10.1 s after admission, 1 s of it on a live scheduler: as predicted
        scope.finish("OK")
    assert admission.calibration.factor("gen", BATCH, clock()) == pytest.approx(1.0)
    held = admission.scope("Generate", "gen")
    admission.admit(held, None, 30.0, priority=BATCH, objective=lambda: NO_OVERRIDE)
    held.model_permit.unserved()
    clock.advance(20.0)
    held.finish("DEADLINE_EXCEEDED")  # ended while no scheduler could take it: nothing learned
    assert admission.calibration.factor("gen", BATCH, clock()) == pytest.approx(1.0)


def test_a_long_prompt_s_own_prefill_is_no_error_of_the_wait_s_prediction(clock):
    """The board predicts a one-token prompt; each scheduler also says what each token of a stream's own prompt
    adds (ModelPressure.ttft_per_prompt_token_ns). Streams of 1 000-token prompts that took 1.1 s where one token
    was predicted 0.1 s at 1 ms a token ran as predicted: nothing to correct, where the bare ratio read 11x."""
    def taught(num_prompt_tokens: int) -> float:
        admission, board = _admission(clock)
        for _ in range(20):
            board.update("a:1", [_batch_report(100.0, queue_depth=0, ns_per_prompt_token=1_000_000)])
            scope = admission.scope("Generate", "gen")
            admission.admit(scope, None, 30.0, priority=BATCH, objective=lambda: NO_OVERRIDE,
                            num_prompt_tokens=num_prompt_tokens)
            clock.advance(1.1)
            scope.tokens_sent(1)
            scope.finish("OK")
        return admission.calibration.factor("gen", BATCH, clock())

    assert taught(1001) == pytest.approx(1.0)
    assert taught(0) == pytest.approx(MAX_FACTOR), "the prompt's length unknown: its prefill reads as the wait's error"


def test_a_stream_s_own_prefill_is_part_of_the_ttft_it_is_judged_and_routed_on(clock):
    """The factor is learned against the board's prediction plus the prompt's prefill (above), so it is judged on
    the same: a 4 000-token prompt at 1 ms a token starts 4 s later than a one-token prompt, past a 5 s target
    where the wait alone (1.5 s) is not. Routing's target for the replicas' one-token predictions leaves room for it."""
    admission, board = _admission(clock, calibrate=False)

    def report() -> None:  # 1.5 s of waiting: streams queue there
        board.update("a:1", [_batch_report(1500.0, ns_per_prompt_token=1_000_000)])

    def admitted(num_prompt_tokens: int):
        report()
        scope = admission.scope("Generate", "gen")
        admission.admit(scope, None, 30.0, priority=BATCH, objective=lambda: NO_OVERRIDE,
                        num_prompt_tokens=num_prompt_tokens)
        return scope

    short = admitted(1001)
    assert short.predicted_ttft_s == pytest.approx(2.5) and short.own_prefill_s == pytest.approx(1.0)
    assert _ttft_target_s(short) == pytest.approx(4.0), "a replica predicting 4 s for one token would start it at 5 s"
    with pytest.raises(ResourceExhausted, match="would start a sheddable stream in 5500 ms"):
        admitted(4001)


def test_the_aggregate_report_keeps_the_fastest_worker_s_cost_per_prompt_token(clock):
    board = PressureBoard(clock)
    report = PressureReport.from_fields("gen", [0, 0, 0, 0], 0, 0.0, 1, 10_000, 8, [0, 0, 0, 100_000], 5_000,
                                        [0, 0, 0, 0], 2_000)
    older = PressureReport.from_fields("gen", [0, 0, 0, 0], 0, 0.0, 1, 10_000, 8, [0, 0, 0, 200_000], 5_000)
    board.update("a:1", [report])
    board.update("b:1", [older])  # an older scheduler reports none (0): unknown, not free
    assert board.pressure("gen").ttft_per_prompt_token_s == pytest.approx(2e-6)


def test_with_nothing_waiting_a_stream_is_not_refused_as_overloaded_for_its_own_prompt_or_a_cold_correction(clock):
    """A scheduler with no stream waiting starts a new one on its next steps: neither the stream's own prefill (here
    4 000 tokens at 1 ms, past the 5 s target) nor a correction learned from streams that started late for their own
    reasons (a cold start: x4) makes that overload, and a retry would fare no better. Once a stream sent there
    since the poll waits (no first response yet), or the poll saw streams waiting, both count again."""
    admission, board = _admission(clock)
    board.update("a:1", [_batch_report(1000.0)])
    _burst(admission, clock, 20, 4.0)  # these started 4x later than predicted
    board.update("a:1", [_batch_report(300.0, queue_depth=0, ns_per_prompt_token=1_000_000)])  # 1 ms a token
    scope = admission.scope("Generate", "gen")
    admission.admit(scope, None, 30.0, priority=BATCH, objective=lambda: NO_OVERRIDE, num_prompt_tokens=4001)
    assert scope.ttft_correction > 3, "the correction is still learned and sent on"
    waiting = board.sent("a:1", "gen", BATCH)  # that stream now waits there until it starts
    with pytest.raises(ResourceExhausted, match="past its TTFT target 5000 ms"):
        admission.admit(admission.scope("Generate", "gen"), None, 30.0, priority=BATCH,
                        objective=lambda: NO_OVERRIDE, num_prompt_tokens=4001)
    waiting.started()  # its first token came: nothing waits there again, before the next poll says so
    admission.admit(admission.scope("Generate", "gen"), None, 30.0, priority=BATCH,
                    objective=lambda: NO_OVERRIDE, num_prompt_tokens=4001)
    board.update("a:1", [_batch_report(300.0, queue_depth=1, ns_per_prompt_token=1_000_000)])
    with pytest.raises(ResourceExhausted, match="past its TTFT target 5000 ms"):
        admission.admit(admission.scope("Generate", "gen"), None, 30.0, priority=BATCH,
                        objective=lambda: NO_OVERRIDE, num_prompt_tokens=4001)


def test_nothing_waiting_needs_a_fresh_idle_scheduler_predicting_within_the_target(clock):
    board = PressureBoard(clock, max_report_age_s=5.0)
    assert not board.nothing_waiting("gen", BATCH, 5.0), "no report: not known to be idle"
    board.update("a:1", [_batch_report(300.0, queue_depth=2)])
    board.update("b:1", [_batch_report(6000.0, queue_depth=0)])  # nothing waits, but slots stay full past 5 s
    assert not board.nothing_waiting("gen", BATCH, 5.0)
    board.update("c:1", [_batch_report(300.0, queue_depth=0)])
    assert board.nothing_waiting("gen", BATCH, 5.0) and not board.nothing_waiting("other", BATCH, 5.0)
    board.sent("c:1", "gen", BATCH)
    assert not board.nothing_waiting("gen", BATCH, 5.0)
    board.update("c:1", [_batch_report(300.0, queue_depth=0)])
    clock.advance(6.0)
    assert not board.nothing_waiting("gen", BATCH, 5.0), "a stale report says nothing"


def test_a_stream_sent_since_the_poll_waits_until_it_starts_and_one_the_poll_did_not_queue_runs(clock):
    """A stream sent since the poll may be queued there until it starts; one sent before a poll that queued nothing
    is running (prefilling). A stream that starts twice (its first chunk, then its attempt's end) counts once, and
    one sent under an earlier poll does not stand in for one sent since."""
    board = PressureBoard(clock)
    board.update("c:1", [_batch_report(300.0, queue_depth=0)])
    before = board.sent("c:1", "gen", BATCH)
    assert not board.nothing_waiting("gen", BATCH, 5.0)
    board.update("c:1", [_batch_report(300.0, queue_depth=0)])
    assert board.nothing_waiting("gen", BATCH, 5.0), "the poll queued nothing: it runs"
    first, second = board.sent("c:1", "gen", BATCH), board.sent("c:1", "gen", BATCH)
    for stream in (before, first, first):
        stream.started()
    assert not board.nothing_waiting("gen", BATCH, 5.0), "the second still waits"
    second.started()
    assert board.nothing_waiting("gen", BATCH, 5.0)
    gone = board.sent("c:1", "gen", BATCH)
    board.forget("c:1")
    board.update("c:1", [_batch_report(300.0, queue_depth=0)])
    assert board.nothing_waiting("gen", BATCH, 5.0), "the poll after it queued nothing"
    gone.started()
    assert board.nothing_waiting("gen", BATCH, 5.0)


def test_a_poll_s_queue_of_this_gateway_s_streams_waits_no_longer_once_they_started(clock):
    """A poll's queue_depth that this gateway's unstarted streams account for: once they all run, nothing waits, not
    a poll interval later (a quiet mesh's next request). A queue longer than they were holds another gateway's
    streams, never seen start here, and stays busy; so does one of ours that is still prefilling."""
    board = PressureBoard(clock)
    board.update("c:1", [_batch_report(300.0, queue_depth=0)])
    mine = [board.sent("c:1", "gen", BATCH) for _ in range(2)]
    board.update("c:1", [_batch_report(300.0, queue_depth=1)])  # one queued, the other prefilling
    mine[0].started()
    assert not board.nothing_waiting("gen", BATCH, 5.0), "the other one has not started"
    mine[1].started()
    assert board.nothing_waiting("gen", BATCH, 5.0)
    board.update("c:1", [_batch_report(300.0, queue_depth=0)])
    assert board.nothing_waiting("gen", BATCH, 5.0)
    more = [board.sent("c:1", "gen", BATCH) for _ in range(2)]
    board.update("c:1", [_batch_report(300.0, queue_depth=3)])  # ours and another gateway's
    for stream in more:
        stream.started()
    assert not board.nothing_waiting("gen", BATCH, 5.0), "the other gateway's stream may still wait"
    board.update("c:1", [_batch_report(300.0, queue_depth=0)])
    assert board.nothing_waiting("gen", BATCH, 5.0)


def test_a_further_choice_is_admitted_past_the_ttft_target_its_first_choice_was_judged_by(clock):
    """n > 1: the first choice's admission judged the request's TTFT target; the others, sent once it streamed, are
    not refused for it (the request would fail part-way for its own choices). Their objective still resolves (TPOT
    paces them), and their TTFT, a burst the request sent itself, teaches the correction nothing."""
    admission, board = _admission(clock)
    board.update("a:1", [_batch_report(8000.0)])  # 8 s of queue against the batch class's 5 s target
    with pytest.raises(ResourceExhausted, match="past its TTFT target 5000 ms"):
        admission.admit(admission.scope("Generate", "gen"), None, 30.0, priority=BATCH, objective=lambda: NO_OVERRIDE)
    further = admission.scope("Generate", "gen")
    admission.admit(further, None, 30.0, priority=BATCH, objective=lambda: NO_OVERRIDE, judge_ttft=False)
    assert further.objective is not None and further.objective.ttft_ms == 5000.0
    assert further.predicted_ttft_s is None and further.on_ttft is None


def test_a_further_choice_goes_upstream_with_its_tpot_target_and_no_ttft_target(clock):
    """n > 1 (openai_choices.py): the scheduler judges no TTFT target for a further choice (0: none), as the gateway
    judged none, and still paces it by its TPOT target; the first choice carries both."""
    admission, board = _admission(clock)
    board.update("a:1", [_batch_report(8000.0)])  # past every class's TTFT target
    core = GenerateCore(admission, dispatcher=None)  # type: ignore[arg-type]
    caller = SimpleNamespace(authorization=None, timeout_s=30.0, priority=BATCH.name.lower(), ttft_ms=None,
                             tpot_ms="80")
    request = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name="gen"), prompt="hi")
    core._admit(admission.scope("Generate", "gen"), request, caller, 0.0, further_choice=True)  # type: ignore[arg-type]
    assert (request.objectives.ttft_ms, request.objectives.tpot_ms) == (0, 80)
