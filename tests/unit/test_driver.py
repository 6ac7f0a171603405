"""The decision driver: pure, no shell."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from sgdjob_operator.api.models import SGDJobSpec
from sgdjob_operator.policy import Rescale, SwitchMode, job_view
from sgdjob_operator.policy.driver import (
    FIRST_STEP_POLL,
    DriverState,
    Observed,
    Push,
    Refused,
    Scale,
    action_for,
    active_mode,
    drive,
    first_call_wait,
    issue,
    load_state,
    restarted,
)
from sgdjob_operator.policy.splits import FAST_STEPS
from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.wire.control import ControlCommand
from tests.unit.policy_feed import STRAGGLER, Scrapes, feed, spec_for


def run_driver(spec: SGDJobSpec, scrapes: Scrapes, in_flight: dict[float, str] | None = None) -> list[Any]:
    """Drive through `scrapes` with every command applied at once; the steps."""
    state, out = DriverState(), []
    for t, samples in scrapes:
        observed = Observed(samples, applied_epoch=state.epoch, in_flight=(in_flight or {}).get(t, ""))
        step = drive(state, observed, spec, t)
        state = step.state
        out.append(step)
    return out


def test_a_straggler_is_rebalanced_after_persisting() -> None:
    steps = run_driver(spec_for(policy={"allowedActions": ["rebalance"]}), feed([STRAGGLER] * 6))
    assert [s.decision.action for s in steps] == ["keep", "keep", "keep", "rebalance", "keep", "keep"]
    push = steps[3].action
    assert isinstance(push, Push) and push.command.epoch == 1 and push.command.batch_sizes is not None
    assert push.command.batch_sizes[3] < 32 < push.command.batch_sizes[0]
    assert steps[3].state.policy.last_change == 30.0


def dated(scrapes: Scrapes) -> Scrapes:
    """The same scrapes from trainers that say how long they have trained (training began at t=0)."""
    return [(t, [dataclasses.replace(s, training_seconds=t) for s in samples]) for t, samples in scrapes]


@pytest.mark.parametrize("persistence", [1, 2, 3, 5])
def test_a_straggler_from_the_start_is_acted_on_at_the_first_interval_where_persistence_holds(
    persistence: int,
) -> None:
    spec = spec_for(policy={"allowedActions": ["rebalance"], "persistenceIntervals": persistence})
    interval = spec.policy.interval_seconds
    # Training begins at t=0; the shell's first policy call comes one interval later.
    scrapes = feed([STRAGGLER] * 8)[1:]
    acted = [s.state.policy.last_change for s in run_driver(spec, dated(scrapes)) if s.action is not None]
    assert acted[0] == persistence * interval, "every interval since training start counts"
    # A trainer that does not date its start costs the first call as a baseline: one interval more.
    undated = [s.state.policy.last_change for s in run_driver(spec, scrapes) if s.action is not None]
    assert undated[0] == (persistence + 1) * interval


def test_the_first_call_waits_for_a_window_from_the_training_start_and_never_again() -> None:
    spec = spec_for(policy={"allowedActions": ["rebalance"]})
    interval = spec.policy.interval_seconds
    samples = feed([STRAGGLER] * 2)[1][1]
    young = [dataclasses.replace(s, training_seconds=(0.3 if s.rank == 0 else 0.1) * interval) for s in samples]
    # The first worker to begin has trained 0.3 interval; the window must be half an interval long.
    assert first_call_wait(DriverState(), young, interval) == pytest.approx(0.2 * interval)
    grown = [dataclasses.replace(s, training_seconds=0.6 * interval) for s in samples]
    assert first_call_wait(DriverState(), grown, interval) == 0.0
    assert first_call_wait(DriverState(), samples, interval) == 0.0, "an undated trainer is not waited for"
    step = drive(DriverState(), Observed(grown, applied_epoch=0), spec, 10.0)
    assert step.state.policy.evaluations == 1
    assert first_call_wait(step.state, young, interval) == 0.0, "once evaluated, the shell keeps its interval"
    after, _ = restarted(step.state, 20.0, 4, 32, 0)
    assert first_call_wait(after, young, interval) > 0, "a new world waits for its own first window"


def test_the_first_call_also_waits_for_every_ranks_second_step_within_the_first_window() -> None:
    interval = 10.0
    samples = feed([STRAGGLER] * 2)[1][1]
    # Half an interval trained, but the slow rank is still in its first step (warm-up, mostly).
    slow = [dataclasses.replace(s, training_seconds=0.5 * interval, steps=1 if s.rank == 3 else 4) for s in samples]
    assert first_call_wait(DriverState(), slow, interval) == pytest.approx(FIRST_STEP_POLL * interval)
    two = [dataclasses.replace(s, steps=max(s.steps, int(FAST_STEPS))) for s in slow]
    assert first_call_wait(DriverState(), two, interval) == 0.0
    # Never past the point where the first window would outgrow FirstWindow.longest.
    late = [dataclasses.replace(s, training_seconds=1.0 * interval) for s in slow]
    assert first_call_wait(DriverState(), late, interval) == 0.0
    # Calls while the workers started up (no step, no training start) do not count as the first.
    spec = spec_for(policy={"allowedActions": ["rebalance"]})
    idle = [dataclasses.replace(s, steps=0, samples=0, compute_seconds=0.0, training_seconds=None) for s in samples]
    early = drive(DriverState(), Observed(idle, applied_epoch=0), spec, 1.0).state
    assert early.policy.evaluations == 1
    assert first_call_wait(early, slow, interval) == pytest.approx(FIRST_STEP_POLL * interval)


def test_in_flight_holds_without_starting_a_cooldown_and_persistence_starts_over() -> None:
    spec = spec_for(policy={"allowedActions": ["rebalance"]})
    busy = {30.0: "worker pods terminating", 40.0: "worker pods terminating"}
    steps = run_driver(spec, feed([STRAGGLER] * 9), in_flight=busy)
    held = steps[3]
    assert held.decision.action == "keep" and held.action is None and held.held == "rebalance"
    assert "held: worker pods terminating" in held.decision.reason
    assert held.state.policy.last_change is None and held.state.policy.candidate_streak == 0
    # Three windows once the change has landed (50, 60, 70), not at once.
    assert [s.decision.action for s in steps[4:]] == ["keep", "keep", "keep", "rebalance", "keep"]


def test_an_unapplied_command_is_in_flight() -> None:
    spec, scrapes = spec_for(policy={"allowedActions": ["rebalance"]}), feed([STRAGGLER] * 5)
    state = issue(DriverState(), ControlCommand(epoch=0, mode=SyncMode.SYNC, reason="spec.mode"))
    steps = []
    for t, samples in scrapes:  # rank 0 reports epoch 0 throughout
        steps.append(drive(state, Observed(samples, applied_epoch=0), spec, t))
        state = steps[-1].state
    assert all(s.action is None for s in steps) and steps[3].held == "rebalance"
    assert "held: control epoch 1 not applied yet" in steps[3].decision.reason and state.policy.last_change is None
    t, samples = feed([STRAGGLER] * 8)[-1]
    assert drive(state, Observed(samples, applied_epoch=1), spec, t).decision.action == "keep"  # persisting anew


def test_epochs_increase_and_commands_merge_by_the_one_rule() -> None:
    state = issue(DriverState(), ControlCommand(epoch=0, batch_sizes={0: 40, 1: 24}, reason="a"))
    state = issue(state, ControlCommand(epoch=0, mode=SyncMode.HIERARCHICAL, groups=[[0], [1]], reason="b"))
    assert state.epoch == 2 and state.command is not None
    assert (state.command.epoch, state.command.mode, state.command.batch_sizes) == (
        2,
        SyncMode.HIERARCHICAL,
        {0: 40, 1: 24},
    )
    # A restarted trainer that reports a later epoch than ours: the next one is above it.
    later = issue(state, ControlCommand(epoch=0, batch_sizes={1: 30}), applied_epoch=7)
    assert later.epoch == 8 and later.command is not None and later.command.batch_sizes == {0: 40, 1: 30}
    assert DriverState.from_dict(json.loads(json.dumps(later.to_dict()))) == later


def test_rescale_is_clamped_and_a_no_op_is_refused() -> None:
    spec = spec_for(policy={"allowedActions": ["rescale"]})
    samples = feed([STRAGGLER])[0][1]
    view = job_view(spec, replicas=4)
    fewer = Rescale(replicas=1, reason="fewer", remove_ranks=(3, 2))
    _, scale = action_for(DriverState(), fewer, Observed(samples), spec, view)
    assert isinstance(scale, Scale) and (scale.replicas, scale.current, scale.remove_nodes) == (
        3,
        4,
        ("node-3", "node-2"),
    )
    with pytest.raises(Refused, match="keeps 4 nodes"):
        action_for(DriverState(), Rescale(replicas=9, reason="more"), Observed(samples), spec, view)


def test_a_healthy_job_below_its_goal_grows_back_unless_held_or_not_allowed() -> None:
    """The operator's case: its shrink lowered spec.replicas to 3; the user's 4 is the goal."""
    spec = spec_for(replicas=3, policy={"allowedActions": ["rescale"]})
    healthy = feed([[100.0] * 3] * 6)

    def actions(goal: int | None, busy: str = "", spec: SGDJobSpec = spec) -> list[Any]:
        state, out = DriverState(), []
        for t, samples in healthy:
            step = drive(state, Observed(samples, applied_epoch=0, in_flight=busy, goal_replicas=goal), spec, t)
            state, out = step.state, [*out, step.action]
        return out

    grown = actions(4)
    assert grown[:3] == [None] * 3  # a baseline, then persistence
    scale = grown[3]
    assert isinstance(scale, Scale) and (scale.replicas, scale.current, scale.remove_ranks) == (4, 3, ())
    assert scale.remove_pods == () and scale.exclude_node is None
    assert "grow to 4 nodes" in scale.decision.reason and scale.decision.predicted_gain > 0
    assert grown[4:] == [None, None]  # one change; then the cooldown (and in the operator, in flight)
    assert actions(None) == [None] * 6  # without a goal above spec.replicas: nothing to grow to
    assert actions(4, busy="3 of 3 workers ready") == [None] * 6
    assert actions(4, spec=spec_for(replicas=3, policy={"allowedActions": ["rebalance"]})) == [None] * 6


def test_a_rescale_names_the_pods_and_node_of_the_ranks_it_removes() -> None:
    spec = spec_for(policy={"allowedActions": ["rescale"]})
    samples = feed([STRAGGLER])[0][1]
    slow = Rescale(replicas=3, reason="slow node", remove_ranks=(1,), exclude_node="node-1")
    _, scale = action_for(DriverState(), slow, Observed(samples), spec, job_view(spec, replicas=4))
    assert isinstance(scale, Scale)
    assert (scale.remove_pods, scale.remove_nodes, scale.exclude_node) == (("job-worker-1",), ("node-1",), "node-1")


def test_a_fixed_mode_is_never_switched() -> None:
    spec = spec_for(mode="sync", policy={"allowedActions": ["switchMode"]})
    steps = run_driver(spec, feed([[100.0, 100.0, 50.0, 50.0]] * 8))
    assert all(s.action is None for s in steps)
    with pytest.raises(Refused, match=r"spec\.mode fixes sync"):
        action_for(DriverState(), SwitchMode("async", "x"), Observed([]), spec, job_view(spec))


def test_a_policy_error_is_a_keep_with_the_problem_and_the_state_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    spec, scrapes = spec_for(), feed([STRAGGLER] * 3)
    state = run_driver(spec, scrapes[:2])[-1].state

    def broken(*_: Any) -> Any:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr("sgdjob_operator.policy.driver.evaluate", broken)
    step = drive(state, Observed(scrapes[2][1]), spec, 20.0)
    assert step.decision.action == "keep" and step.action is None and step.state.policy == state.policy
    assert step.problem == "policy evaluation failed: ZeroDivisionError: division by zero"


def test_stored_state_that_cannot_be_read_starts_afresh_with_the_problem() -> None:
    state, problem = load_state("{not json", {"epoch": "x"}, "bogus")
    assert state == DriverState() and "policy state dropped" in problem and "command dropped" in problem
    kept, none = load_state(DriverState().policy_json(), {"epoch": 3, "mode": "async"}, "sync")
    assert none == "" and kept.epoch == 3 and kept.mode == "sync"


def test_active_mode_prefers_what_the_workers_run() -> None:
    spec = spec_for()
    samples = feed([STRAGGLER])[0][1]
    told = DriverState(command=ControlCommand(epoch=1, mode=SyncMode.ASYNC), epoch=1)
    assert active_mode(told, Observed(samples), spec) == "sync"
    mixed = [samples[0], dataclasses.replace(samples[1], mode="async")]  # mid-switch: what they were told
    assert active_mode(told, Observed(mixed), spec) == "async"
    last = dataclasses.replace(told, mode="sync")
    assert active_mode(last, Observed(mixed), spec) == "sync"  # what they last all ran
    assert active_mode(told, Observed([]), spec) == "async"
    assert active_mode(DriverState(mode="hierarchical"), Observed([]), spec) == "hierarchical"
    assert active_mode(DriverState(), Observed([]), spec) == spec.initial_mode.value


def test_a_membership_change_starts_the_policy_over_and_resets_batch_sizes() -> None:
    state = issue(DriverState(), ControlCommand(epoch=0, batch_sizes={0: 40, 1: 24, 2: 32}))
    after, command = restarted(state, 500.0, 2, 32, applied_epoch=1)
    assert after.policy.last_change == 500.0 and after.policy.ranks == {}
    assert command is not None and command.epoch == 2 and command.batch_sizes == {0: 32, 1: 32}
    assert restarted(DriverState(epoch=4), 1.0, 2, 32, None)[1] is None


def test_no_change_is_made_that_the_job_ends_before_repaying() -> None:
    """A grow-back decided near the last step would restart the world for a job about to finish
    (CI saw a node added at step 193 of 200 find the rendezvous closed)."""
    spec = spec_for(replicas=3, policy={"allowedActions": ["rescale"]}, training={"batchSize": 32, "steps": 400})
    healthy = feed([[100.0] * 3] * 8)

    def decisions(step_at: Any) -> list[Any]:
        state, out = DriverState(), []
        for i, (t, samples) in enumerate(healthy):
            step = drive(state, Observed(samples, applied_epoch=0, goal_replicas=4, step=step_at(i)), spec, t)
            state, out = step.state, [*out, step.decision]
        return out

    early = decisions(lambda i: 30 * i)  # steps 90 of 400 at the decision: hundreds of seconds left
    assert [d.action for d in early[:4]] == ["keep"] * 3 + ["rescale"]
    late = decisions(lambda i: 370 + i)  # about 10 s left at 3 steps/s: a pod restart never repays
    assert all(d.action == "keep" for d in late)
    assert "the job ends in about" in late[-1].reason and "steps)" in late[-1].reason, late[-1].reason
    unknown = decisions(lambda i: None)  # a shell that does not know the step decides as before
    assert [d.action for d in unknown[:4]] == ["keep"] * 3 + ["rescale"]
