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

A shrink (a rescale that only removes pods) is measured apart (`controller.shrinkSeconds`): it
starts no pod, pulls nothing and imports nothing, so the first start, which paid for all of that on
the slowest node, says little of it. On the real-node slow fleet the first start took ~20 s, most of
it the 0.27-CPU node importing torch, and a rescale away from that node never repaid 20 s within a
600-step job; the survivors re-form their world in seconds (sgdjob_trainer.rendezvous_rounds). Until
the job has shrunk once, a shrink is taken to cost `policy.restart.shrink_guess` for the job's model,
or the measured start if that is less (`policy.restart.shrink_estimate`).

How a start is dated from the workers' samples: `policy.restart`.
"""

from __future__ import annotations

from collections.abc import Sequence

from sgdjob_operator.api.models import ControllerState
from sgdjob_operator.k8s.status import parse_time, rfc3339
from sgdjob_operator.policy import WorkerSample
from sgdjob_operator.policy.driver import PlatformCosts
from sgdjob_operator.policy.restart import restart_took, shrink_estimate

RESTART_GUESS_SECONDS = PlatformCosts().restart_seconds  # the platform's default, until measured


def restart_began(ctl: ControllerState, now: float, *, shrink: bool = False) -> None:
    """The policy is changing the world's members now (`shrink`: only removing pods): the next
    world's start is measured from here."""
    ctl.restart_from = rfc3339(now)
    ctl.restart_shrinks = shrink or None


def measure_restart(ctl: ControllerState, samples: Sequence[WorkerSample], created: float | None) -> None:
    """Record in `ctl` what the latest (re)start took, once every rank of the new world trains: from the
    membership change in `ctl.restart_from`, else (first world, nothing measured yet) from `created`."""
    since = parse_time(ctl.restart_from)
    if since is not None:
        if (took := restart_took(samples, since)) is not None:
            if ctl.restart_shrinks:
                ctl.shrink_seconds = took
            else:
                ctl.restart_seconds = took
            ctl.restart_from, ctl.restart_shrinks = None, None
        return
    if ctl.restart_seconds is None and created is not None:
        ctl.restart_seconds = restart_took(samples, created)


def restart_estimate(ctl: ControllerState) -> float:
    """Seconds a membership change is expected to pause training: the job's own latest figure."""
    return ctl.restart_seconds if ctl.restart_seconds is not None else RESTART_GUESS_SECONDS


def job_shrink_estimate(ctl: ControllerState, samples: Sequence[WorkerSample] = ()) -> float:
    """Seconds a shrink is expected to pause training (`policy.restart.shrink_estimate`), for the model
    the workers' `samples` report."""
    return shrink_estimate(ctl.shrink_seconds, restart_estimate(ctl), samples)
