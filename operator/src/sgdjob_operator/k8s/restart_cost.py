"""What a restart of the job's world costs, measured on the job itself, for the policy's payback rule.

The policy weighs a membership change (replaceWorker, rescale) by the training it pauses
(`PlatformCosts.restart_seconds`, then `JobView.restart_seconds`): a change must repay that pause
within its horizon. The platform's guess, RESTART_GUESS_SECONDS, is a cluster that schedules a pod
and pulls its image onto a new node; on nodes that hold the image a world restarts in seconds, and
the guess kept a rescale that would have paid from ever being made (the real-node benchmark's slow
node: ddp-drop reached the target in a third of DDP's time). So the job measures its own: from its
creation until every rank of its first world trained, and after each membership change the policy
makes, from that change until every rank of the new world trained. The latest figure is kept in
status (`controller.restartSeconds`) and read back every pass, so a restarted operator keeps it.

How a start is dated from the workers' samples: `policy.restart`.
"""

from __future__ import annotations

from collections.abc import Sequence

from sgdjob_operator.api.models import ControllerState
from sgdjob_operator.k8s.status import parse_time, rfc3339
from sgdjob_operator.policy import WorkerSample
from sgdjob_operator.policy.driver import PlatformCosts
from sgdjob_operator.policy.restart import restart_took

RESTART_GUESS_SECONDS = PlatformCosts().restart_seconds  # the platform's default, until measured


def restart_began(ctl: ControllerState, now: float) -> None:
    """The policy is changing the world's members now: the next world's start is measured from here."""
    ctl.restart_from = rfc3339(now)


def measure_restart(ctl: ControllerState, samples: Sequence[WorkerSample], created: float | None) -> None:
    """Record in `ctl` what the latest (re)start took, once every rank of the new world trains: from the
    membership change in `ctl.restart_from`, else (first world, nothing measured yet) from `created`."""
    since = parse_time(ctl.restart_from)
    if since is not None:
        if (took := restart_took(samples, since)) is not None:
            ctl.restart_seconds, ctl.restart_from = took, None
        return
    if ctl.restart_seconds is None and created is not None:
        ctl.restart_seconds = restart_took(samples, created)


def restart_estimate(ctl: ControllerState) -> float:
    """Seconds a membership change is expected to pause training: the job's own latest figure."""
    return ctl.restart_seconds if ctl.restart_seconds is not None else RESTART_GUESS_SECONDS
