"""What the local runner does about an agent that died (a lost node): restart it after a backoff,
replace a node in a crash loop, or fail the job once runPolicy.backoffLimit is spent."""

from __future__ import annotations

from pathlib import Path

from sgdjob_operator.local.deaths import (
    Death,
    RestartPolicy,
    backoff,
    caused_by_store,
    decide,
    decide_store,
    describe_exit,
)
from sgdjob_operator.local.report import summary_lines
from sgdjob_operator.local.revive import last_checkpoint
from sgdjob_trainer.wire.launch_contract import EXIT_RENDEZVOUS_TIMEOUT

POLICY = RestartPolicy(backoff_limit=5, min_nodes=2, crash_loop_deaths=3, crash_loop_window_s=60.0)


def test_a_dead_agent_is_restarted_after_a_backoff_that_doubles_per_death_of_its_node() -> None:
    first = decide(POLICY, [Death("local-3", 10.0, -9)], live=3)
    assert first.action == "restart" and first.delay_s == 1.0
    assert "agent local-3 died (killed by SIGKILL)" in first.reason and "the others go on" in first.reason
    assert "death 1 of backoffLimit 5" in first.reason
    # Another node's death does not lengthen local-3's backoff; local-3's second death does.
    deaths = [Death("local-3", 10.0, -9), Death("local-1", 20.0, 1), Death("local-3", 200.0, -9)]
    assert decide(POLICY, deaths[:2], live=3).delay_s == 1.0
    assert decide(POLICY, deaths, live=3).delay_s == 2.0
    assert [backoff(POLICY, n) for n in (1, 2, 3, 4, 10)] == [1.0, 2.0, 4.0, 8.0, 30.0]


def test_below_min_replicas_the_others_wait_for_the_restart() -> None:
    verdict = decide(POLICY, [Death("local-1", 5.0, -9)], live=1)
    assert verdict.action == "restart" and "wait for minReplicas 2" in verdict.reason


def test_a_node_that_keeps_dying_within_the_window_is_replaced() -> None:
    deaths = [Death("local-3", t, -9) for t in (10.0, 30.0, 65.0)]
    verdict = decide(POLICY, deaths, live=3)
    assert verdict.action == "replace" and "crash loop: 3 deaths within 60s" in verdict.reason
    # The same deaths spread beyond the window are restarts.
    spread = [Death("local-3", t, -9) for t in (10.0, 80.0, 150.0)]
    assert decide(POLICY, spread, live=3).action == "restart"


def test_deaths_beyond_the_backoff_limit_fail_the_job_naming_the_node_and_the_count() -> None:
    policy = RestartPolicy(backoff_limit=1, min_nodes=2)
    deaths = [Death("local-3", 10.0, -9), Death("local-2", 30.0, 1)]
    assert decide(policy, deaths[:1], live=3).action == "restart"
    verdict = decide(policy, deaths, live=3)
    assert verdict.action == "fail"
    assert verdict.reason.startswith("agent local-2 died (exit code 1): 2 agent deaths exceed runPolicy.backoffLimit 1")
    assert "spec.runPolicy.backoffLimit" in verdict.reason
    assert decide(RestartPolicy(backoff_limit=0, min_nodes=1), deaths[:1], live=0).action == "fail"


def test_exits_are_described_by_signal_or_code() -> None:
    assert describe_exit(-15) == "killed by SIGTERM" and describe_exit(3) == "exit code 3"
    assert describe_exit(-200) == "killed by signal 200"


def test_the_last_checkpoint_is_the_newest_complete_step(tmp_path: Path) -> None:
    assert last_checkpoint(None) is None and last_checkpoint(tmp_path) is None
    for step, complete in ((20, True), (40, True), (60, False)):
        (tmp_path / f"step-{step:010d}").mkdir()
        if complete:
            (tmp_path / f"step-{step:010d}" / "COMPLETE").write_text("x")
    assert last_checkpoint(tmp_path) == 40


def test_the_run_summary_tells_each_death_and_its_recovery() -> None:
    deaths = [
        {"node": "local-3", "time_s": 12.34, "exit": "killed by SIGKILL", "action": "restart", "lost_steps": 7,
         "recovery_s": 6.2},
        {"node": "local-1", "time_s": 40.0, "exit": "exit code 1", "action": "fail", "lost_steps": 3,
         "recovery_s": None},
    ]  # fmt: skip
    lines = summary_lines({"agent_deaths": deaths})
    assert "agent local-3 died at 12.3s (killed by SIGKILL): restart, 7 steps lost, recovered in 6.2s" in lines
    assert "agent local-1 died at 40.0s (exit code 1): fail, 3 steps lost" in lines


def test_a_dead_store_is_restarted_unless_it_keeps_dying() -> None:
    first = decide_store([30.0], -9)
    assert first.action == "restart" and "rendezvous store died (killed by SIGKILL)" in first.reason
    assert "same port" in first.reason and "backoffLimit" in first.reason
    # Six deaths within two minutes: the store cannot stay up; one a minute is restarted each time.
    assert decide_store([10.0 * i for i in range(6)], 1).action == "fail"
    assert "logs/rendezvous" in decide_store([10.0 * i for i in range(6)], 1).reason
    assert decide_store([60.0 * i for i in range(10)], 1).action == "restart"


def test_agents_dying_of_a_lost_store_are_not_charged_to_the_backoff_limit() -> None:
    assert caused_by_store(45.0, [30.0]) and not caused_by_store(29.0, [30.0]) and not caused_by_store(200.0, [30.0])
    strict = RestartPolicy(backoff_limit=0, min_nodes=2, crash_loop_deaths=2)
    lost = [Death(f"local-{i}", 40.0 + i, 1, infrastructure=True) for i in range(4)]
    # Every agent of a backoffLimit-0 job dies of the store (twice for local-0): each is restarted.
    for n in range(1, 5):
        verdict = decide(strict, lost[:n], live=4 - n)
        assert verdict.action == "restart" and "not counted against runPolicy.backoffLimit" in verdict.reason
    again = [*lost, Death("local-0", 80.0, 1, infrastructure=True)]
    assert decide(strict, again, live=0).action == "restart"  # no crash loop either
    # A user's crash still counts, and the infrastructure deaths before it do not add to it.
    crash = decide(strict, [*again, Death("local-2", 300.0, 1)], live=3)
    assert crash.action == "fail" and "1 agent deaths exceed runPolicy.backoffLimit 0" in crash.reason


def test_an_agent_whose_rendezvous_timed_out_is_not_charged_to_the_backoff_limit() -> None:
    strict = RestartPolicy(backoff_limit=0, min_nodes=2)
    alone = [Death("local-1", 700.0, EXIT_RENDEZVOUS_TIMEOUT, infrastructure=True)]
    verdict = decide(strict, alone, live=0)
    assert verdict.action == "restart", verdict
    assert "agent local-1 died (exit code 4) of a rendezvous fewer than minReplicas agents joined in time" in (
        verdict.reason
    )
    assert "not counted against runPolicy.backoffLimit" in verdict.reason
    # The peer it waited for, crashing with its own code, still counts.
    crash = decide(strict, [*alone, Death("local-0", 710.0, 1)], live=1)
    assert crash.action == "fail" and "1 agent deaths exceed runPolicy.backoffLimit 0" in crash.reason
