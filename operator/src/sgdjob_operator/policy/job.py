"""The job as the policy sees it: spec knobs plus what runs now. Built by a pure function."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sgdjob_operator.api.models import Action, JobMode, PolicySpec, SGDJobSpec
from sgdjob_operator.policy.comm import CommModel
from sgdjob_trainer.config import LrScaling, SyncMode

# Without a known memory limit, rebalancing gives a rank at most this multiple of the spec batch.
DEFAULT_MAX_BATCH_FACTOR = 4
SYNC_MODES = tuple(m.value for m in SyncMode)
# What a new split of sync's batch costs, in seconds, for the payback rule: the trainers apply it at
# a step boundary (one collective and a broadcast, no restart), measured under 20 ms on the goodput
# benchmark's digits-cnn; the rest is slack for a slow control path. (At 1 s, a re-split that would
# shorten every step by 6 % could not repay itself within 15 s and was never made.)
# Measured and set on the tuning set: one-straggler re-splits, digits-cnn, interval 0.5 s, seeds 0-2 (d05f263).
REBALANCE_SECONDS = 0.2


@dataclass(frozen=True, slots=True)
class JobView:
    """Everything `evaluate` needs to know about the job besides the samples.

    `mode` is the active mode (what the workers run now); `requested_mode` is spec.mode (auto lets
    the policy switch). `batch_sizes` and `max_batch_sizes` are per global rank; a rank absent from
    them has `base_batch` and `max_batch`. `restart_seconds` is what a membership change costs
    (re-rendezvous plus resuming from a checkpoint), `shrink_seconds` one that only removes workers
    (no pod to start; None: `restart_seconds`), `switch_seconds` a mode switch, `rebalance_seconds`
    a new split of sync's batch (applied at a step boundary: no pause, but the windows while it lands
    are not measured).
    `in_flight` says why a change is still being applied ('' when none): the policy then holds.
    `goal_replicas` is what the job should run when healthy (0: `replicas`): below it, a healthy
    fleet grows back. `steps_left` is how many of training.steps remain (None: not known): a change
    that cannot repay its pause before the job ends is not made.
    """

    requested_mode: str
    mode: str
    replicas: int
    min_replicas: int
    max_replicas: int
    nproc_per_node: int
    base_batch: int
    policy: PolicySpec
    comm: CommModel = field(default_factory=CommModel)
    batch_sizes: Mapping[int, int] = field(default_factory=dict)
    groups: tuple[tuple[int, ...], ...] | None = None
    group_by_node: bool = True
    average_every: int = 4
    hier_staleness: int = 2
    async_staleness: int | None = 8
    ps_shards: int = 1
    staleness_lr: str = "none"
    lr_scaling: str = "linear"
    max_batch: int = 0
    max_batch_sizes: Mapping[int, int] = field(default_factory=dict)
    restart_seconds: float = 60.0
    shrink_seconds: float | None = None
    switch_seconds: float = 5.0
    rebalance_seconds: float = REBALANCE_SECONDS
    in_flight: str = ""
    goal_replicas: int = 0
    steps_left: int | None = None

    @property
    def goal(self) -> int:
        """Nodes to grow back to, within maxReplicas."""
        return min(self.goal_replicas or self.replicas, self.max_replicas)

    @property
    def world_size(self) -> int:
        return self.replicas * self.nproc_per_node

    @property
    def auto(self) -> bool:
        return self.requested_mode == JobMode.AUTO.value

    @property
    def shrink_cost(self) -> float:
        """Seconds a shrink pauses training: its own figure where the shell has one."""
        return self.shrink_seconds if self.shrink_seconds is not None else self.restart_seconds

    def allows(self, action: Action) -> bool:
        return action in self.policy.allowed_actions

    def batch(self, rank: int) -> int:
        return self.batch_sizes.get(rank, self.base_batch)

    def cap(self, rank: int) -> int:
        return max(self.max_batch_sizes.get(rank, self.max_batch or DEFAULT_MAX_BATCH_FACTOR * self.base_batch), 1)

    def lr_ratio(self, world: int) -> float:
        """Per-sample learning rate at `world` processes (same per-rank batches) relative to now,
        under training.lrScaling: the trainer scales the rate by the world size, linearly (1 per
        sample), by its square root, or not at all."""
        now = self.world_size
        if world <= 0 or now <= 0:
            return 1.0
        return LrScaling(self.lr_scaling).factor(world, now) * now / world

    @property
    def global_batch(self) -> int:
        return sum(self.batch(r) for r in range(self.world_size))

    @property
    def planned_batch(self) -> int:
        """The global batch of plain sync on this world (a trimmed split's is smaller)."""
        return self.base_batch * self.world_size

    @property
    def plain(self) -> bool:
        """Synchronous with every rank at the spec batch: where a job rests when nothing is wrong."""
        return self.mode == SyncMode.SYNC.value and all(
            self.batch(r) == self.base_batch for r in range(self.world_size)
        )


def job_view(
    spec: SGDJobSpec,
    *,
    mode: str | None = None,
    replicas: int | None = None,
    batch_sizes: Mapping[int, int] | None = None,
    groups: Sequence[Sequence[int]] | None = None,
    comm: CommModel | None = None,
    max_batch_sizes: Mapping[int, int] | None = None,
    restart_seconds: float = 60.0,
    shrink_seconds: float | None = None,
    switch_seconds: float = 5.0,
    rebalance_seconds: float = REBALANCE_SECONDS,
    in_flight: str = "",
    goal_replicas: int | None = None,
    step: int | None = None,
) -> JobView:
    """The policy's view of a job: `spec` plus the active mode (default: the mode workers start
    in), the current replicas (default spec.replicas), per-rank batch sizes and hierarchical groups
    in force, the job's step now, and optionally what is known about the network and per-rank
    memory limits."""
    active = mode if mode is not None else spec.initial_mode.value
    if active not in SYNC_MODES:
        raise ValueError(f"mode must be one of {', '.join(SYNC_MODES)}, not {active!r}")
    hier = spec.training.hierarchical
    policy = spec.policy
    if spec.training.on_adaptation_api:
        # A script on the adaptation API keeps its own learning rate: no trimmed batch (which the
        # trainer pairs with a learning rate scaled to it). It may switch among sync, hierarchical and
        # async where its ranks say they can (sgdjob_hierarchical_capable, sgdjob_async_capable): the
        # candidates read both.
        kept = [a for a in policy.allowed_actions if a != Action.TRIM_BATCH]
        policy = policy.model_copy(update={"allowed_actions": kept})
    # A command's own arguments decide how long it trains: training.steps says nothing of it.
    steps_left = max(spec.training.steps - step, 0) if step is not None and spec.training.command is None else None
    given_groups = groups if groups is not None else hier.groups
    return JobView(
        requested_mode=spec.mode.value,
        mode=active,
        replicas=replicas if replicas is not None else spec.replicas,
        min_replicas=spec.min_workers,
        max_replicas=spec.max_workers,
        nproc_per_node=spec.nproc_per_node,
        base_batch=spec.training.batch_size,
        policy=policy,
        comm=comm if comm is not None else CommModel(),
        batch_sizes=dict(batch_sizes or {}),
        groups=tuple(tuple(g) for g in given_groups) if given_groups else None,
        group_by_node=hier.group_by.value == "node",
        average_every=hier.average_every,
        hier_staleness=hier.staleness,
        async_staleness=spec.training.async_.staleness,
        ps_shards=spec.training.async_.shards,
        staleness_lr=spec.training.async_.staleness_lr.value,
        lr_scaling=spec.training.lr_scaling.value,
        max_batch_sizes=dict(max_batch_sizes or {}),
        restart_seconds=restart_seconds,
        shrink_seconds=shrink_seconds,
        switch_seconds=switch_seconds,
        rebalance_seconds=rebalance_seconds,
        in_flight=in_flight,
        goal_replicas=goal_replicas if goal_replicas is not None else spec.replicas,
        steps_left=steps_left,
    )
