"""Hang detection: a rank stuck in its compute, or a job where nothing moves, is replaced."""

from __future__ import annotations

import dataclasses

from sgdjob_operator.policy import PolicyState, ReplaceWorker, WorkerSample, evaluate, job_view
from sgdjob_operator.policy.hang import find_hang
from tests.unit.policy_feed import spec_for

TIMEOUT = 60.0


def _sample(rank: int, stalled: float | None, computing: bool | None, time: float = 100.0) -> WorkerSample:
    return WorkerSample(
        rank, time, 10, 320, 1.0, 0.5, "sync", 32, node=f"n{rank}", pod=f"j-worker-{rank}",
        stalled_seconds=stalled, computing=computing,
    )  # fmt: skip


def _latest(*samples: WorkerSample) -> dict[int, WorkerSample]:
    return {s.rank: s for s in samples}


def test_the_rank_stuck_in_its_compute_is_the_hung_one_not_those_waiting_for_it() -> None:
    hang = find_hang(_latest(_sample(0, 61, False), _sample(1, 70, True), _sample(2, 61, False)), 3, TIMEOUT)
    assert hang is not None and (hang.rank, hang.pod, hang.stuck) == (1, "j-worker-1", True)
    assert "rank 1 (pod j-worker-1)" in hang.reason(TIMEOUT) and "stuck in its own compute" in hang.reason(TIMEOUT)


def test_slow_moving_silent_or_unknown_ranks_are_no_hang() -> None:
    assert find_hang(_latest(_sample(0, 59, True), _sample(1, 59, False)), 2, TIMEOUT) is None, "under the timeout"
    assert find_hang(_latest(_sample(0, 500, True)), 1, None) is None, "hangTimeoutSeconds omitted: never"
    assert find_hang(_latest(_sample(0, None, None), _sample(1, None, None)), 2, TIMEOUT) is None, "older trainers"
    # Async: one rank waits on a peer for long while the others move: slow, not hung.
    assert find_hang(_latest(_sample(0, 90, False), _sample(1, 0.1, True)), 2, TIMEOUT) is None


def test_a_job_where_nothing_moves_blames_a_silent_rank_else_rank_0() -> None:
    waiting = _latest(_sample(0, 80, False), _sample(2, 75, False))
    hang = find_hang(waiting, 3, TIMEOUT)
    assert hang is not None and (hang.rank, hang.pod, hang.stuck, hang.stalled_s) == (1, None, False, 80)
    hang = find_hang({**waiting, 1: _sample(1, 70, False)}, 3, TIMEOUT)
    assert hang is not None and (hang.rank, hang.pod, hang.stuck) == (0, "j-worker-0", False)
    assert "restarts the round from the last checkpoint" in hang.reason(TIMEOUT)


def test_the_policy_replaces_a_hung_worker_at_once_and_gives_the_recovery_time() -> None:
    spec = spec_for(policy={"hangTimeoutSeconds": TIMEOUT, "allowedActions": ["rebalance"]})
    view = job_view(spec)
    samples = [_sample(r, 61.0 if r != 2 else 65.0, r == 2) for r in range(4)]
    ev = evaluate(PolicyState(), samples, view, 100.0)
    assert isinstance(ev.decision, ReplaceWorker), ev.decision
    assert (ev.decision.rank, ev.decision.pod, ev.decision.exclude_node) == (2, "j-worker-2", None)
    assert ev.decision.hung and ev.decision.to_dict()["hung"] is True
    assert ev.state.last_change == 100.0, "no persistence, no cooldown: the timeout was the wait"
    later = [dataclasses.replace(s, time=130.0, stalled_seconds=(s.stalled_seconds or 0) + 30) for s in samples]
    again = evaluate(ev.state, later, view, 130.0)
    assert not isinstance(again.decision, ReplaceWorker), "the recovery gets a hang timeout to show progress"
    off = spec_for(policy={"hangTimeoutSeconds": None})
    assert not isinstance(evaluate(PolicyState(), samples, job_view(off), 100.0).decision, ReplaceWorker)
