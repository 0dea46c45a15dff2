"""The rollout controller: moves a canary's share through its policy's steps and rolls back at once.

Per model with a `rollout` policy in the routing file (rollout/policy.py):

    start ─▶ step 0 (shadow: mirrored only) ─▶ 1% ─▶ 10% ─▶ ... ─▶ last step ─▶ PROMOTED
                         │ any check fails (rollout_analysis.judge)
                         └──────────────────────────────────────▶ ROLLED_BACK (share 0, held)

Every `tick()` judges each running rollout's step on the version-less requests that finished
since the step began (baseline = the default version, canary = the canary version; at the
shadow step, the mirrored calls and their output comparisons). A verdict that moves the rollout
is a `Decision`: it changes the routing table's shares (`RoutingTable.set_shares`) in the same
call, is logged with its evidence, counted, kept (the last MAX_DECISIONS per model) and saved.

With golden cases in the policy (rollout/golden.py), the decider's run loop also sends them to the
canary (`golden_due` -> `prober` -> `golden_done`, rollout/probe.py) at every step's start and every
interval; the judgement rolls back on a wrong answer and advances no step before a run passed.

By hand, in the routing file (`override`): pause holds the current share and decides nothing;
abort sets the share to 0; promote to 100. Removing the override resumes the automatic path at
the step it held (a paused or aborted rollout; a rollback is final for its attempt: change
`attempt` to start over). Any other change of the policy starts a new rollout from step 0.
The same four by RPC (`control`, Admin/ControlRollout, `infermesh rollout`) at the decider: the
file wins while it names an override; a state set by RPC is kept across reloads of a file without
one, and saved like any other (`Progress.by_rpc`), until the next RPC or a file override.

One decider: only the gateway started with the decider role judges and writes the state store
(rollout/store.py); the others read the store each tick and apply its shares, so every replica
routes alike and a restarted gateway goes on where the rollout was (the step's timer carries
over; its samples do not, so the step gathers its minimum again).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.gateway.rollout.analysis import Judgement, Verdict, judge
from services.gateway.rollout.golden import CaseAnswer, GoldenCase, GoldenOutcome, compare
from services.gateway.rollout.policy import Override, RolloutPolicy, Step
from services.gateway.rollout.window import Window
from services.gateway.telemetry import metrics

log = logging.getLogger(__name__)

MAX_DECISIONS = 20
# A golden run left incomplete (a case shed, unavailable or out of time) is tried again this soon.
GOLDEN_RETRY_S = 1.0


class RolloutState(enum.Enum):
    RUNNING = "running"  # the analysis decides each step
    PAUSED = "paused"  # by hand: the current share holds, nothing is decided
    ROLLED_BACK = "rolled_back"  # a check failed: share 0, held for this attempt
    PROMOTED = "promoted"  # every step passed (or promoted by hand): the last step's share
    ABORTED = "aborted"  # by hand: share 0


class HandAction(enum.Enum):
    """What an operator asks of a rollout by RPC (the routing file's overrides, plus resume)."""

    PAUSE = "pause"
    RESUME = "resume"
    ABORT = "abort"
    PROMOTE = "promote"


# The states each action may start from (RESUME: only a state set by hand; see control()).
_ALLOWED_FROM = {
    HandAction.PAUSE: {RolloutState.RUNNING},
    HandAction.RESUME: {RolloutState.PAUSED, RolloutState.ABORTED, RolloutState.PROMOTED},
    HandAction.ABORT: {RolloutState.RUNNING, RolloutState.PAUSED, RolloutState.PROMOTED},
    HandAction.PROMOTE: {RolloutState.RUNNING, RolloutState.PAUSED, RolloutState.ABORTED, RolloutState.ROLLED_BACK},
}
_TARGET = {HandAction.PAUSE: RolloutState.PAUSED, HandAction.RESUME: RolloutState.RUNNING,
           HandAction.ABORT: RolloutState.ABORTED, HandAction.PROMOTE: RolloutState.PROMOTED}


class RoutedModel(Protocol):
    """A routing file's model as the controller reads it (routing/table.py's RoutedModel): the
    rollout package sits below routing and knows it only through this and `Shares`."""

    @property
    def model(self) -> str: ...

    @property
    def default_version(self) -> str: ...

    @property
    def rollout(self) -> RolloutPolicy | None: ...


class Shares(Protocol):
    """The routing table's side of the controller (RoutingTable)."""

    def set_shares(self, model: str, shares: dict[str, float] | None) -> None: ...


@dataclass(frozen=True)
class Decision:
    model: str
    canary_version: str
    # Unix seconds.
    at_s: float
    # start | advance | promote | roll_back | pause | resume | abort
    action: str
    from_step: str
    to_step: str
    # The judgement's evidence line, or who decided ("by hand").
    evidence: str

    def describe(self) -> str:
        move = self.to_step if self.from_step == self.to_step else f"{self.from_step} -> {self.to_step}"
        return f"rollout {self.model} canary {self.canary_version}: {self.action} {move} ({self.evidence})"


@dataclass
class Progress:
    """One model's rollout as the store keeps it (JSON-ready via to_dict)."""

    rollout_id: str
    canary_version: str
    state: RolloutState
    step_index: int
    # Unix seconds when the current step began (its timer survives a restart).
    step_started_s: float
    # The state was set by an override, so removing the override resumes the automatic path.
    by_hand: bool = False
    # ... and that override came by RPC (control()), so a routing file without one keeps it.
    by_rpc: bool = False
    decisions: list[Decision] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"rollout_id": self.rollout_id, "canary_version": self.canary_version, "state": self.state.value,
                "step_index": self.step_index, "step_started_s": self.step_started_s, "by_hand": self.by_hand,
                "by_rpc": self.by_rpc,
                "decisions": [asdict(d) for d in self.decisions]}

    @classmethod
    def from_dict(cls, data: dict) -> Progress:
        """Raises KeyError, TypeError or ValueError on a record that is not one."""
        return cls(
            rollout_id=str(data["rollout_id"]), canary_version=str(data["canary_version"]),
            state=RolloutState(data["state"]), step_index=int(data["step_index"]),
            step_started_s=float(data["step_started_s"]), by_hand=bool(data.get("by_hand", False)),
            by_rpc=bool(data.get("by_rpc", False)),
            decisions=[Decision(**d) for d in data.get("decisions", [])],
        )


class RolloutStore(Protocol):
    def load(self) -> dict[str, dict]: ...

    def save(self, records: dict[str, dict]) -> None: ...


@dataclass(frozen=True)
class ShadowTarget:
    version: str
    # Share of the baseline's version-less requests to mirror, (0, 100].
    percent: float
    max_in_flight: int


@dataclass(frozen=True)
class GoldenTarget:
    """One run of a rollout's golden cases against its canary (golden_due -> golden_done)."""

    model: str
    version: str
    cases: tuple[GoldenCase, ...]
    # Which step's run this is: an answer that comes back after the step changed is dropped.
    run_id: int


class GoldenProber(Protocol):
    """Sends golden cases to a version (rollout/probe.py): one answer per case, in order."""

    async def answers(self, model: str, version: str, cases: Sequence[GoldenCase]) -> list[CaseAnswer]: ...


@dataclass
class _GoldenRun:
    """The golden check within one step: the latest complete run, when the next is due."""

    run_id: int
    due_s: float = 0.0
    in_flight: bool = False
    outcome: GoldenOutcome | None = None


@dataclass
class _Rollout:
    model: str
    default_version: str
    policy: RolloutPolicy
    progress: Progress
    baseline: Window = field(default_factory=Window)
    canary: Window = field(default_factory=Window)
    last: Judgement | None = None
    golden: _GoldenRun = field(default_factory=lambda: _GoldenRun(run_id=0))

    @property
    def step(self) -> Step:
        return self.policy.steps[min(self.progress.step_index, len(self.policy.steps) - 1)]

    def share_percent(self) -> float:
        state = self.progress.state
        if state in (RolloutState.ROLLED_BACK, RolloutState.ABORTED):
            return 0.0
        if state is RolloutState.PROMOTED:
            return 100.0 if self.progress.by_hand else self.policy.steps[-1].percent
        return self.step.percent


class RolloutController:
    def __init__(self, routing: Shares, store: RolloutStore | None = None, *, decider: bool = True,
                 clock: Callable[[], float] = time.time) -> None:
        """clock: unix seconds (step timers are saved and outlive the process)."""
        self._routing = routing
        self._store = store
        self.decider = decider
        self._clock = clock
        self._rollouts: dict[str, _Rollout] = {}
        self._saved = self._load() if store is not None else {}
        # Sends golden cases to canaries (the gateway sets it; None: golden checks cannot run).
        self.prober: GoldenProber | None = None
        self._num_golden_runs = 0
        self._golden_tasks: set[asyncio.Task] = set()

    # -- the routing file ----------------------------------------------------------------

    def apply_routes(self, routes: Iterable[RoutedModel]) -> None:
        """The routing file (first load or reload): start, keep, override or drop each model's rollout."""
        routes = tuple(routes)
        with_policy = {r.model: r for r in routes if r.rollout is not None}
        for model in set(self._rollouts) - set(with_policy):
            del self._rollouts[model]
            self._routing.set_shares(model, None)
            metrics.forget_rollout(model)
        changed = False
        for route in with_policy.values():
            changed |= self._reconcile(route)
        if changed:
            self._save()

    def _reconcile(self, route: RoutedModel) -> bool:
        policy = route.rollout
        assert policy is not None
        rollout = self._rollouts.get(route.model)
        changed = False
        if rollout is None or rollout.progress.rollout_id != policy.rollout_id:
            rollout = self._resume_saved(route, policy) or self._start(route, policy)
            self._rollouts[route.model] = rollout
            changed = True
        rollout.policy, rollout.default_version = policy, route.default_version
        changed |= self._apply_override(rollout)
        self._publish(rollout)
        return changed

    def _resume_saved(self, route: RoutedModel, policy: RolloutPolicy) -> _Rollout | None:
        record = self._saved.pop(route.model, None)
        if record is None or record.rollout_id != policy.rollout_id:
            return None
        log.info("rollout %s canary %s: resumed %s at step %s from the state store", route.model,
                 record.canary_version, record.state.value, record.step_index)
        return _Rollout(route.model, route.default_version, policy, record)

    def _start(self, route: RoutedModel, policy: RolloutPolicy) -> _Rollout:
        progress = Progress(policy.rollout_id, policy.canary_version, RolloutState.RUNNING, 0, self._clock())
        rollout = _Rollout(route.model, route.default_version, policy, progress)
        self._decide(rollout, "start", rollout.step, rollout.step,
                     f"steps {', '.join(s.name for s in policy.steps)}; each needs {policy.min_requests} canary "
                     f"requests and {policy.min_duration_s:g} s; confidence {policy.confidence:g}; attempt "
                     f"{policy.attempt}")
        return rollout

    def _apply_override(self, rollout: _Rollout) -> bool:
        override, progress = rollout.policy.override, rollout.progress
        target = {Override.PAUSE: RolloutState.PAUSED, Override.ABORT: RolloutState.ABORTED,
                  Override.PROMOTE: RolloutState.PROMOTED}.get(override)
        if target is not None and progress.state is target and progress.by_rpc:
            progress.by_rpc = False  # the file now holds what an RPC set: removing it from the file resumes
            return True
        if target is not None and (progress.state is not target or not progress.by_hand):
            if progress.state is target:  # reached by the analysis already: nothing to do
                return False
            if target is RolloutState.PAUSED and not progress.by_hand and progress.state is not RolloutState.RUNNING:
                return False  # a rollback or a promotion is final: there is nothing running to pause
            self._set_state(rollout, target, by_hand=True, action=override.value, evidence="by hand")
            return True
        if target is None and progress.by_hand and not progress.by_rpc:
            self._set_state(rollout, RolloutState.RUNNING, by_hand=False, action="resume", evidence="by hand")
            self._begin_step(rollout, progress.step_index)
            return True
        return False

    # -- by RPC --------------------------------------------------------------------------

    def control(self, model: str, action: HandAction, who: str = "by hand") -> tuple[Decision | None, RolloutView]:
        """Pause, resume, abort or promote `model`'s rollout; the decision made (None: already there)
        and the rollout after it. `who` goes into the decision's evidence (e.g. "by hand, tenant ops").

        Raises FailedPrecondition (a follower; the routing file's override holds it; a move the state
        does not allow), NotFound (no rollout for the model) or InvalidArgument (no model)."""
        if not model:
            raise InvalidArgument("a model is required")
        if not self.decider:
            raise FailedPrecondition(f"this gateway is a rollout follower (--rollout-role follower): "
                                     f"{action.value} {model}'s rollout at the gateway whose --rollout-role is "
                                     "decider; followers apply what it saves in the state file")
        rollout = self._rollouts.get(model)
        if rollout is None:
            raise NotFound(f"model {model!r} has no rollout policy in the routing file")
        progress = rollout.progress
        if rollout.policy.override is not Override.AUTOMATIC:
            raise FailedPrecondition(f"the routing file's override {rollout.policy.override.value!r} holds "
                                     f"{model}'s rollout; remove it from the file to act by RPC")
        target = _TARGET[action]
        if progress.state is target:
            return None, self._view(model, rollout)
        by_hand_only = action is HandAction.RESUME and not progress.by_hand
        if progress.state not in _ALLOWED_FROM[action] or by_hand_only:
            raise FailedPrecondition(f"cannot {action.value} {model}'s rollout: it is {progress.state.value}"
                                     + (" by the analysis" if by_hand_only else "")
                                     + (" (a rollback is final for its attempt: change the policy's attempt "
                                        "to start over)" if progress.state is RolloutState.ROLLED_BACK else ""))
        if action is HandAction.RESUME:
            decision = self._set_state(rollout, RolloutState.RUNNING, by_hand=False, action="resume", evidence=who)
            self._begin_step(rollout, progress.step_index)
        else:
            decision = self._set_state(rollout, target, by_hand=True, by_rpc=True, action=action.value, evidence=who)
        self._save()
        return decision, self._view(model, rollout)

    # -- requests ------------------------------------------------------------------------

    def record(self, model: str, version: str, code: str, duration_s: float,
               stages_s: Iterable[tuple[str, float]] = ()) -> None:
        """A version-less request finished (routed by the shares), on `version`."""
        rollout = self._rollouts.get(model)
        if rollout is None or rollout.progress.state is not RolloutState.RUNNING:
            return
        if version == rollout.default_version:
            rollout.baseline.record(code, duration_s, stages_s)
        elif version == rollout.policy.canary_version and not rollout.step.shadow:
            rollout.canary.record(code, duration_s, stages_s)

    def shadow_target(self, model: str) -> ShadowTarget | None:
        """Where to mirror `model`'s version-less requests now, or None (no shadow step running)."""
        rollout = self._rollouts.get(model)
        if rollout is None or rollout.progress.state is not RolloutState.RUNNING or not rollout.step.shadow:
            return None
        policy = rollout.policy
        return ShadowTarget(policy.canary_version, policy.shadow_percent, policy.shadow_max_in_flight)

    def max_score_drift(self, model: str) -> float:
        """The policy's classify score tolerance for shadow comparisons of `model`."""
        rollout = self._rollouts.get(model)
        return rollout.policy.checks.max_score_drift if rollout is not None else 0.0

    def record_shadow(self, model: str, version: str, code: str, duration_s: float,
                      stages_s: Iterable[tuple[str, float]] = (), agreed: bool | None = None) -> None:
        """A mirrored call finished; `agreed` is its output comparison (None: nothing to compare)."""
        rollout = self._rollouts.get(model)
        if rollout is None or not rollout.step.shadow or version != rollout.policy.canary_version:
            return
        rollout.canary.record(code, duration_s, stages_s)
        if agreed is not None:
            rollout.canary.compared(agreed)

    # -- deciding ------------------------------------------------------------------------

    def tick(self) -> list[Decision]:
        """Judge every running rollout once (the decider), or follow the store (the others)."""
        if not self.decider:
            self._follow()
            return []
        made: list[Decision] = []
        for rollout in self._rollouts.values():
            if rollout.progress.state is RolloutState.RUNNING:
                made.extend(self._judge(rollout))
        if made:
            self._save()
        return made

    def _judge(self, rollout: _Rollout) -> list[Decision]:
        progress = rollout.progress
        judgement = judge(rollout.policy, rollout.step, rollout.baseline, rollout.canary,
                          max(0.0, self._clock() - progress.step_started_s), rollout.golden.outcome)
        rollout.last = judgement
        if judgement.verdict is Verdict.ROLL_BACK:
            return [self._set_state(rollout, RolloutState.ROLLED_BACK, by_hand=False, action="roll_back",
                                    evidence=judgement.evidence())]
        if judgement.verdict is Verdict.WAIT:
            return []
        if progress.step_index + 1 >= len(rollout.policy.steps):
            return [self._set_state(rollout, RolloutState.PROMOTED, by_hand=False, action="promote",
                                    evidence=judgement.evidence())]
        before = rollout.step
        self._begin_step(rollout, progress.step_index + 1)
        decision = self._decide(rollout, "advance", before, rollout.step, judgement.evidence())
        self._publish(rollout)
        return [decision]

    def _begin_step(self, rollout: _Rollout, index: int) -> None:
        rollout.progress.step_index = index
        rollout.progress.step_started_s = self._clock()
        if rollout.step.percent < 100:
            rollout.baseline = Window()
        # At 100% no request reaches the baseline: the canary is judged against the last step's.
        rollout.canary = Window()
        self._num_golden_runs += 1
        rollout.golden = _GoldenRun(run_id=self._num_golden_runs, due_s=self._clock())  # every step: at once

    def _set_state(self, rollout: _Rollout, state: RolloutState, *, by_hand: bool, action: str,
                   evidence: str, by_rpc: bool = False) -> Decision:
        rollout.progress.state, rollout.progress.by_hand, rollout.progress.by_rpc = state, by_hand, by_rpc
        decision = self._decide(rollout, action, rollout.step, rollout.step, evidence)
        self._publish(rollout)
        return decision

    def _decide(self, rollout: _Rollout, action: str, before: Step, after: Step, evidence: str) -> Decision:
        decision = Decision(rollout.model, rollout.policy.canary_version, self._clock(), action, before.name,
                            after.name, evidence)
        decisions = rollout.progress.decisions
        decisions.append(decision)
        del decisions[:-MAX_DECISIONS]
        (log.warning if action in ("roll_back", "abort") else log.info)("%s", decision.describe())
        metrics.rollout_decision(rollout.model, action)
        return decision

    def _publish(self, rollout: _Rollout) -> None:
        """The share in force, into the routing table and the gauges."""
        percent = rollout.share_percent()
        self._routing.set_shares(rollout.model, {rollout.policy.canary_version: percent})
        metrics.observe_rollout(rollout.model, rollout.policy.canary_version, rollout.progress.state.value,
                                rollout.progress.step_index, percent)

    # -- the store -----------------------------------------------------------------------

    def _load(self) -> dict[str, Progress]:
        assert self._store is not None
        loaded: dict[str, Progress] = {}
        for model, record in self._store.load().items():
            try:
                loaded[model] = Progress.from_dict(record)
            except (KeyError, TypeError, ValueError) as exc:
                log.error("rollout state store: ignoring the record of model %r (%s: %s)", model,
                          type(exc).__name__, exc)
        return loaded

    def _save(self) -> None:
        if self._store is None or not self.decider:
            return
        records = {model: progress.to_dict() for model, progress in self._saved.items()}
        records.update({model: r.progress.to_dict() for model, r in self._rollouts.items()})
        self._store.save(records)

    def _follow(self) -> None:
        if self._store is None:
            return
        saved = self._load()
        for model, rollout in self._rollouts.items():
            record = saved.get(model)
            if record is not None and record.rollout_id == rollout.progress.rollout_id:
                rollout.progress = record
                self._publish(rollout)

    # -- golden checks -------------------------------------------------------------------

    def golden_due(self) -> list[GoldenTarget]:
        """The golden runs to start now (the decider's running rollouts with cases), marked in flight."""
        if not self.decider:
            return []
        due: list[GoldenTarget] = []
        for model, rollout in self._rollouts.items():
            golden, run = rollout.policy.checks.golden, rollout.golden
            if (golden is None or rollout.progress.state is not RolloutState.RUNNING or run.in_flight
                    or self._clock() < run.due_s):
                continue
            if run.run_id == 0:  # started or resumed from the store: this step's first run
                self._num_golden_runs += 1
                run.run_id = self._num_golden_runs
            run.in_flight = True
            due.append(GoldenTarget(model, rollout.policy.canary_version, golden.cases, run.run_id))
        return due

    def golden_done(self, target: GoldenTarget, answers: Sequence[CaseAnswer]) -> GoldenOutcome | None:
        """A golden run's answers: its outcome, judged at the next tick (None: the step moved on)."""
        rollout = self._rollouts.get(target.model)
        if rollout is None or rollout.golden.run_id != target.run_id or rollout.policy.checks.golden is None:
            return None
        outcome = compare(target.cases, answers)
        run = rollout.golden
        run.in_flight = False
        metrics.golden_run(target.model, target.version,
                           "failed" if outcome.mismatches else "passed" if outcome.complete else "incomplete")
        if outcome.complete:
            run.outcome = outcome
            run.due_s = self._clock() + rollout.policy.checks.golden.interval_s
            (log.warning if outcome.mismatches else log.info)(
                "rollout %s canary %s: golden check %d/%d right%s", target.model, target.version, outcome.num_passed,
                outcome.num_cases, "; " + "; ".join(outcome.mismatches) if outcome.mismatches else "")
        else:
            run.due_s = self._clock() + GOLDEN_RETRY_S
            log.info("rollout %s canary %s: golden check incomplete (%d of %d cases unanswered); again in %g s",
                     target.model, target.version, outcome.num_unanswered, outcome.num_cases, GOLDEN_RETRY_S)
        return outcome

    def _start_golden_runs(self) -> None:
        if self.prober is None:
            return
        for target in self.golden_due():
            task = asyncio.get_running_loop().create_task(self._golden_run(self.prober, target),
                                                          name=f"golden {target.model} {target.version}")
            self._golden_tasks.add(task)
            task.add_done_callback(self._golden_tasks.discard)

    async def _golden_run(self, prober: GoldenProber, target: GoldenTarget) -> None:
        try:
            answers = await prober.answers(target.model, target.version, target.cases)
        except Exception:  # a bug in the prober: logged, and the run counts as unanswered (tried again)
            log.exception("golden check of %s version %s failed", target.model, target.version)
            answers = [CaseAnswer(code="UNAVAILABLE", message="prober failed")] * len(target.cases)
        self.golden_done(target, answers)

    async def run(self, interval_s: float) -> None:
        try:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    # Golden runs due start before the judgement too: a step whose first tick already
                    # rolls back (a shadow disagreement is decisive on a few requests) still runs and
                    # logs its golden cases. Then again after it, for the step an advance began.
                    self._start_golden_runs()
                    self.tick()
                    self._start_golden_runs()
                except Exception:  # a bug here must not stop the next tick; it is logged with its trace
                    log.exception("rollout tick failed")
        finally:
            for task in list(self._golden_tasks):
                task.cancel()

    # -- reading -------------------------------------------------------------------------

    def views(self) -> list[RolloutView]:
        return [self._view(model, r) for model, r in sorted(self._rollouts.items())]

    @staticmethod
    def _view(model: str, r: _Rollout) -> RolloutView:
        last = r.progress.decisions[-1] if r.progress.decisions else None
        return RolloutView(
            model=model, canary_version=r.policy.canary_version, state=r.progress.state.value,
            step=r.step.name, step_index=r.progress.step_index, num_steps=len(r.policy.steps),
            canary_percent=r.share_percent(), num_baseline=r.baseline.num_requests,
            num_canary=r.canary.num_compared if r.step.shadow else r.canary.num_requests,
            last_decision=last.describe() if last is not None else "",
            judgement=r.last.evidence() if r.last is not None else "")

    def decisions(self, model: str) -> list[Decision]:
        rollout = self._rollouts.get(model)
        return list(rollout.progress.decisions) if rollout is not None else []


@dataclass(frozen=True)
class RolloutView:
    """One row of the admin status' `rollouts` section."""

    model: str
    canary_version: str
    state: str
    step: str
    step_index: int
    num_steps: int
    canary_percent: float
    num_baseline: int
    num_canary: int
    last_decision: str
    # The latest judgement's evidence (the decider only).
    judgement: str
