"""Rank 0's failed checkpoint writes (a full volume) become one CheckpointFailed Warning per new failure
batch, naming the error and the last good checkpoint; a restarted rank 0 that counts from 0 again is
heard too, and a repeated scrape with nothing new stays quiet."""

from __future__ import annotations

from sgdjob_operator.api.models import SGDJobStatus
from sgdjob_operator.k8s.observe import checkpoint_failures
from sgdjob_operator.k8s.status import controller
from sgdjob_trainer.wire.worker_status import CheckpointReport, Figures, WorkerStatus

ENOSPC = "OSError: [Errno 28] No space left on device"


def rank0(failed: int, completed: list[int]) -> WorkerStatus:
    report = CheckpointReport(
        stall_seconds=Figures(),
        write_seconds=Figures(),
        completed=completed,
        failed=failed,
        last_error=ENOSPC if failed else None,
        last_error_step=90 if failed else None,
    )
    return WorkerStatus(rank=0, checkpoint=report)


def test_new_failures_are_one_warning_each_time_and_none_when_nothing_changed() -> None:
    st = SGDJobStatus()
    assert checkpoint_failures(st, rank0(0, [30])) == []
    (event,) = checkpoint_failures(st, rank0(2, [30]))
    assert event.type == "Warning" and event.reason == "CheckpointFailed"
    assert "2 checkpoint write(s) failed" in event.message and "No space left on device" in event.message
    assert "of step 90" in event.message and "the last good checkpoint: step 30" in event.message
    assert checkpoint_failures(st, rank0(2, [30])) == []  # the next scrape: nothing new
    (more,) = checkpoint_failures(st, rank0(3, [30]))
    assert more.message.startswith("1 checkpoint write(s) failed (3 since rank 0 started)")
    # A new life of rank 0 counts from 0: its failures are news.
    (fresh,) = checkpoint_failures(st, rank0(1, []))
    assert "none written by this life" in fresh.message and controller(st).checkpoint_failures == 1
