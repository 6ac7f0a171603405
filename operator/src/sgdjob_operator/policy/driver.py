"""The one decision driver: from what a shell observed to what it must do. Pure, and it never raises.

Every shell (the Kubernetes operator, `sgdjob run`, the simulator) calls `drive` once per policy
interval and carries out the `Action` it returns through its `Actuator`. The driver owns what the
shells must agree on: the active mode, the policy's view of the job, the in-flight gate, control
epochs and the merged command, the min/max clamp and what a failing policy amounts to (a keep).

In-flight gating: while a change is still being applied (the shell says why, or rank 0 has not
applied the latest epoch), the policy still measures (health stays current) but is told to hold:
it answers keep and starts no cooldown, and its persistence count starts over once the change has
landed, because windows measured during a change describe neither the old configuration nor the
new one.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from sgdjob_operator.api.models import JobMode, SGDJobSpec
from sgdjob_operator.policy.comm import CommModel
from sgdjob_operator.policy.decisions import Decision, Keep, Rebalance, ReplaceWorker, Rescale, SwitchMode
from sgdjob_operator.policy.engine import evaluate
from sgdjob_operator.policy.health import JobHealth
from sgdjob_operator.policy.job import REBALANCE_SECONDS, SYNC_MODES, JobView, job_view
from sgdjob_operator.policy.measure import FirstWindow
from sgdjob_operator.policy.samples import WorkerSample
from sgdjob_operator.policy.splits import FAST_STEPS
from sgdjob_operator.policy.state import PolicyState
from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.wire.control import ControlCommand, merge


@dataclass(frozen=True, slots=True)
class DriverState:
    """What the driver keeps between calls, all of it serialisable: the policy's state, the merge
    of every command sent (what the workers should run; a restarted trainer gets it whole), the
    last epoch issued and the mode the workers were last all seen running."""

    policy: PolicyState = field(default_factory=PolicyState)
    command: ControlCommand | None = None
    epoch: int = 0
    mode: str | None = None

    def policy_json(self) -> str:
        return json.dumps(self.policy.to_dict(), separators=(",", ":"))

    def command_dict(self) -> dict[str, Any] | None:
        return None if self.command is None else self.command.model_dump(mode="json", by_alias=True, exclude_none=True)

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.to_dict(), "command": self.command_dict(), "epoch": self.epoch, "mode": self.mode}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DriverState:
        state, problem = load_state(data.get("policy"), data.get("command"), data.get("mode"))
        if problem:
            raise ValueError(problem)
        return dataclasses.replace(state, epoch=max(state.epoch, int(data.get("epoch") or 0)))


def load_state(
    policy: str | Mapping[str, Any] | None,
    command: Mapping[str, Any] | None,
    mode: str | None,
) -> tuple[DriverState, str]:
    """The state from its stored parts (the operator keeps them in separate status fields), and
    what had to be dropped: a part that cannot be read starts afresh instead of failing the job."""
    problems = []
    try:
        data = json.loads(policy) if isinstance(policy, str) else policy
        if data is not None and not isinstance(data, Mapping):
            raise ValueError("policy state is not a JSON object")
        policy_state = PolicyState.from_dict(data)
    except ValueError as err:
        policy_state = PolicyState()
        problems.append(f"stored policy state dropped: {err}")
    try:
        stored = ControlCommand.model_validate(command) if command else None
    except ValueError as err:
        stored = None
        problems.append(f"stored control command dropped: {err}")
    known = mode if mode in SYNC_MODES else None
    return DriverState(policy_state, stored, stored.epoch if stored is not None else 0, known), "; ".join(problems)


@dataclass(frozen=True, slots=True)
class Observed:
    """One look at the running job. `replicas`: nodes (pods, agents) in the running world, None to
    derive it from the world size the workers report. `batch_sizes`/`groups`: what runs now per
    rank, for a shell that knows it better than the stored command (the simulator renumbers ranks
    without commands). `in_flight`: why the shell sees a change still under way ('' when none).
    `goal_replicas`: the nodes the job should run when healthy, what the policy grows back to after
    a shrink (None: spec.replicas; the operator, whose rescale changes spec.replicas, keeps the
    user's number in status). `step`: the job's step now (None: not known), so that no change is
    made that the job ends before repaying."""

    samples: Sequence[WorkerSample]
    replicas: int | None = None
    applied_epoch: int | None = None
    in_flight: str = ""
    batch_sizes: Mapping[int, int] | None = None
    groups: Sequence[Sequence[int]] | None = None
    goal_replicas: int | None = None
    step: int | None = None

    @property
    def mode(self) -> str | None:
        return unanimous_mode(self.samples)


def unanimous_mode(samples: Sequence[WorkerSample]) -> str | None:
    """The mode every reporting worker runs, or None while they disagree (a switch under way)."""
    modes = {s.mode for s in samples if s.mode in SYNC_MODES}
    return modes.pop() if len(modes) == 1 else None


@dataclass(frozen=True, slots=True)
class PlatformCosts:
    """What the shell knows about its platform, for the cost model (defaults: pods on a cluster)."""

    comm: CommModel | None = None
    max_batch_sizes: Mapping[int, int] | None = None
    restart_seconds: float = 60.0
    shrink_seconds: float | None = None  # a membership change that starts no pod (None: restart_seconds)
    switch_seconds: float = 5.0
    rebalance_seconds: float = REBALANCE_SECONDS


@dataclass(frozen=True, slots=True)
class Push:
    """Send `command` (every command so far, merged) to rank 0; `change` is this decision's part."""

    command: ControlCommand
    change: ControlCommand
    decision: SwitchMode | Rebalance


@dataclass(frozen=True, slots=True)
class Replace:
    """Replace the worker of `rank` (its pod and node as the workers report them); keep the job
    off `exclude_node` when the slowness is bound to that node. `mode`: what the workers run."""

    mode: str
    rank: int
    pod: str | None
    node: str | None
    exclude_node: str | None
    decision: ReplaceWorker


@dataclass(frozen=True, slots=True)
class Scale:
    """Run `replicas` nodes instead of `current` (clamped to min/max); the nodes (pods) of
    `remove_ranks` go first, as the workers report them in `remove_nodes` and `remove_pods`; keep
    the job off `exclude_node` when the slowness was bound to it. `mode`: what the workers run."""

    mode: str
    replicas: int
    current: int
    remove_ranks: tuple[int, ...]
    remove_nodes: tuple[str, ...]
    decision: Rescale
    remove_pods: tuple[str, ...] = ()
    exclude_node: str | None = None


Action = Push | Replace | Scale
R_co = TypeVar("R_co", covariant=True)


class Actuator(Protocol[R_co]):
    """What a shell can do. An implementation records and carries out; it decides nothing."""

    def push(self, action: Push) -> R_co: ...

    def replace(self, action: Replace) -> R_co: ...

    def scale(self, action: Scale) -> R_co: ...


def act(action: Action, actuator: Actuator[R_co]) -> R_co:
    """Hand an action to the actuator method that carries it out."""
    if isinstance(action, Push):
        return actuator.push(action)
    if isinstance(action, Replace):
        return actuator.replace(action)
    return actuator.scale(action)


@dataclass(frozen=True, slots=True)
class Step:
    """The outcome of one call: the state to keep, the policy's decision (a keep when it held or
    failed), what to do (None: nothing), its health when it ran, the action held back because a
    change is in flight, and a problem to report (empty when none)."""

    state: DriverState
    decision: Decision
    action: Action | None = None
    health: JobHealth | None = None
    held: str | None = None
    problem: str = ""


def active_mode(state: DriverState, observed: Observed, spec: SGDJobSpec) -> str:
    """What the workers run now: what they all report, else what they last all ran, else what
    they were told, else the mode they start in."""
    target = state.command.mode.value if state.command is not None and state.command.mode is not None else None
    for mode in (observed.mode, state.mode, target):
        if mode in SYNC_MODES:
            return str(mode)
    return spec.initial_mode.value


def world_replicas(spec: SGDJobSpec, samples: Sequence[WorkerSample]) -> int:
    """Nodes in the running world: what the trainers report, else what the spec asks."""
    sizes = [s.world_size for s in samples if s.world_size > 0]
    return max(1, max(sizes) // spec.nproc_per_node) if sizes else spec.replicas


def pending(state: DriverState, applied_epoch: int | None, mode: str | None) -> ControlCommand | None:
    """The command rank 0 has not applied yet, to (re-)send until it has: the trainer ignores an
    epoch it has seen, so a re-send is harmless. Without an epoch reading, a mode mismatch tells."""
    command = state.command
    if command is None:
        return None
    if applied_epoch is not None:
        return command if applied_epoch < command.epoch else None
    return command if command.mode is not None and mode != command.mode.value else None


# While the first evaluation waits for every rank's FAST_STEPS-th step, a shell looks again after
# this fraction of an interval.
FIRST_STEP_POLL = 0.1


def first_call_wait(state: DriverState, samples: Sequence[WorkerSample], interval_s: float) -> float:
    """Seconds a shell should wait before the policy first evaluates this world (0: evaluate now).

    A rank's first window runs from its process's training start (`policy.measure`). Evaluated
    before that window is `FirstWindow.shortest` long, the ranks would only get a baseline and their
    first rate would come a whole interval later; so a shell that has not evaluated since the world
    began (it has seen no step of it yet: a new job, or after `restarted`) waits until the first
    worker to begin training has trained that long. It then also waits, polling every FIRST_STEP_POLL
    of an interval and never past `FirstWindow.longest`, until every rank has made FAST_STEPS steps:
    a one-step rate is mostly the first step's warm-up, and a split made at once needs two
    (`splits.FAST_GAIN`), so a slow rank's second step would otherwise cost the change an interval.
    Samples that do not date their training start (an older trainer) are not waited for."""
    if any(r.steps > 0 for r in state.policy.ranks.values()):
        return 0.0  # evaluated with steps made: calls before any rank trained had nothing to measure
    dated = [s for s in samples if s.training_seconds is not None]
    if not dated:
        return 0.0
    first = FirstWindow.for_interval(interval_s)
    trained = max(s.training_seconds or 0.0 for s in dated)
    if trained < first.shortest:
        return first.shortest - trained
    if any(s.steps < FAST_STEPS for s in dated) and trained < first.longest - interval_s:
        return FIRST_STEP_POLL * interval_s
    return 0.0


def issue(state: DriverState, change: ControlCommand, applied_epoch: int | None = None) -> DriverState:
    """The state after sending `change` with the next epoch, merged into the command in force."""
    epoch = max(state.epoch, applied_epoch or 0) + 1
    command = merge(state.command, change.model_copy(update={"epoch": epoch}))
    return dataclasses.replace(state, command=command, epoch=epoch)


def drive(
    state: DriverState, observed: Observed, spec: SGDJobSpec, now: float, costs: PlatformCosts = PlatformCosts()
) -> Step:
    """One policy interval: evaluate (held while a change is in flight) and turn the decision into
    an action. A failure of the policy, or a decision no shell may carry out, is a keep with the
    problem reported and the state before it kept, so the cooldown never starts for nothing."""
    mode = active_mode(state, observed, spec)
    seen = dataclasses.replace(state, mode=observed.mode or state.mode)
    unapplied = pending(state, observed.applied_epoch, observed.mode)
    unapplied_note = f"control epoch {unapplied.epoch} not applied yet" if unapplied is not None else ""
    in_flight = observed.in_flight or unapplied_note
    command = state.command
    sizes = observed.batch_sizes if observed.batch_sizes is not None else command.batch_sizes if command else None
    groups = observed.groups if observed.groups is not None else command.groups if command else None
    try:
        view = job_view(
            spec,
            mode=mode,
            replicas=observed.replicas if observed.replicas is not None else world_replicas(spec, observed.samples),
            batch_sizes=sizes,
            groups=groups,
            comm=costs.comm,
            max_batch_sizes=costs.max_batch_sizes,
            restart_seconds=costs.restart_seconds,
            shrink_seconds=costs.shrink_seconds,
            switch_seconds=costs.switch_seconds,
            rebalance_seconds=costs.rebalance_seconds,
            in_flight=in_flight,
            goal_replicas=observed.goal_replicas,
            step=observed.step,
        )
        result = evaluate(state.policy, observed.samples, view, now)
    except Exception as err:  # the policy is pure code; a bug in it is reported, never fatal to a shell
        problem = f"policy evaluation failed: {type(err).__name__}: {err}"
        return Step(seen, Keep(f"policy error: {err}"), problem=problem)
    held = result.held.action if result.held is not None else None
    after = dataclasses.replace(seen, policy=result.state)
    try:
        after, action = action_for(after, result.decision, observed, spec, view)
    except Refused as err:
        return Step(seen, Keep(f"policy error: {err}"), health=result.health, problem=f"policy decision refused: {err}")
    return Step(after, result.decision, action, result.health, held)


class Refused(ValueError):
    """A decision outside what the spec allows: a bug in the policy, treated like one."""


def action_for(
    state: DriverState,
    decision: Decision,
    observed: Observed,
    spec: SGDJobSpec,
    view: JobView,
) -> tuple[DriverState, Action | None]:
    """What carrying out `decision` in the job as `view` sees it takes, and the state after it.
    Raises Refused for a switch of a mode the spec fixes or a rescale the clamp makes a no-op."""
    if isinstance(decision, Keep):
        return state, None
    if isinstance(decision, SwitchMode | Rebalance):
        if isinstance(decision, SwitchMode) and spec.mode is not JobMode.AUTO:
            raise Refused(f"switchMode to {decision.mode}, but spec.mode fixes {spec.mode.value}")
        change = _change(decision)
        after = issue(state, change, observed.applied_epoch)
        assert after.command is not None  # issue always leaves a command
        return after, Push(after.command, change.model_copy(update={"epoch": after.epoch}), decision)
    by_rank = {s.rank: s for s in observed.samples}
    if isinstance(decision, ReplaceWorker):
        seen = by_rank.get(decision.rank)
        pod = decision.pod or (seen.pod if seen else None)
        node = seen.node if seen else None
        return state, Replace(view.mode, decision.rank, pod, node, decision.exclude_node, decision)
    target, replicas = max(spec.min_workers, min(spec.max_workers, decision.replicas)), view.replicas
    if target == replicas:
        bounds = f"min {spec.min_workers}, max {spec.max_workers}"
        raise Refused(f"rescale to {decision.replicas} keeps {replicas} nodes ({bounds})")
    leaving = [by_rank[r] for r in decision.remove_ranks if r in by_rank]
    nodes = tuple(dict.fromkeys(s.node for s in leaving if s.node is not None))
    pods = tuple(dict.fromkeys(s.pod for s in leaving if s.pod is not None))
    removed = decision.remove_ranks
    return state, Scale(view.mode, target, replicas, removed, nodes, decision, pods, decision.exclude_node)


def _change(decision: SwitchMode | Rebalance) -> ControlCommand:
    """The command a mode switch or rebalance amounts to (its epoch is set when it is issued)."""
    sizes = dict(decision.batch_sizes) if decision.batch_sizes is not None else None
    if isinstance(decision, Rebalance):
        return ControlCommand(epoch=0, batch_sizes=sizes, reason=decision.reason)
    groups = [list(g) for g in decision.groups] if decision.groups is not None else None
    mode = SyncMode(decision.mode)
    return ControlCommand(epoch=0, mode=mode, groups=groups, batch_sizes=sizes, reason=decision.reason)


def restarted(
    state: DriverState,
    now: float,
    world: int,
    base_batch: int,
    applied_epoch: int | None,
) -> tuple[DriverState, ControlCommand | None]:
    """After a membership change that hands ranks out anew: the policy starts over with its
    cooldown running from the change, and per-rank batch sizes and groups, which named old ranks,
    are dropped (the workers are told plain sizes when they had others). Returns the state and
    the command to send, if any."""
    policy = dataclasses.replace(PolicyState(), last_change=now, last_pause=now, jitter=state.policy.jitter)
    epoch = max(state.epoch, applied_epoch or 0)
    fresh = DriverState(policy, None, epoch, state.mode)
    if state.command is None or not state.command.batch_sizes:
        return fresh, None
    plain = ControlCommand(
        epoch=0,
        batch_sizes={r: base_batch for r in range(world)},
        reason="membership changed: per-rank batch sizes reset",
    )
    after = issue(fresh, plain)
    return after, after.command
