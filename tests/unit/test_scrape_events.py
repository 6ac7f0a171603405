"""What `kubectl describe sgdjob` tells a person: a worker that does not answer a scrape is a
Warning only when it is a fault (a Running, ready pod silent for longer than the grace period),
never for the expected moments of a healthy run (workers starting, exiting, a change under way);
and the policy's internal state never appears in status."""

from __future__ import annotations

import json
from typing import Any

from sgdjob_operator.api.models import Phase, SGDJobStatus
from sgdjob_operator.api.validation import validate_spec
from sgdjob_operator.k8s.actuator import driver_state, store, stored_policy_state, take_policy_state
from sgdjob_operator.k8s.builders import JobRef, build_policy_state
from sgdjob_operator.k8s.observe import endpoints, quiet_reason, unanswered
from sgdjob_operator.k8s.status import PodView, controller, dump_status, load_status, rfc3339
from sgdjob_operator.policy.state import PolicyState

T0 = 1_800_000_000.0
GRACE = 60.0
REFUSED = "Cannot connect to host: Connection refused"


def _spec() -> Any:
    return validate_spec({"replicas": 2, "minReplicas": 1, "maxReplicas": 2})


def _pod(index: int, phase: str = "Running", *, ready: bool = True, deleting: bool = False) -> PodView:
    return PodView(
        f"j-worker-{index}", f"uid-{index}", "worker", index, phase, ready, f"10.0.0.{index + 1}", "n", deleting
    )


def _running() -> SGDJobStatus:
    return SGDJobStatus(phase=Phase.RUNNING, start_time=rfc3339(T0), mode="sync", target_mode="sync")


def _silent(pods: list[PodView], *which: int) -> tuple[list[Any], dict[str, str]]:
    eps = endpoints(_spec(), pods)
    return eps, {eps[i].url: REFUSED for i in which}


def _passes(
    pods: list[PodView], st: SGDJobStatus, silent: tuple[int, ...], times: list[float]
) -> tuple[list[str], dict[str, float]]:
    """The Warning text of each pass, one per time, with the table carried between passes."""
    table: dict[str, float] = {}
    texts = []
    for t in times:
        eps, errors = _silent(pods, *silent)
        table, text = unanswered(errors, eps, pods, table, now=t, grace_s=GRACE, quiet=quiet_reason(st, _spec(), pods))
        texts.append(text)
    return texts, table


def test_a_running_worker_silent_past_the_grace_is_a_warning_naming_it_and_said_once() -> None:
    pods = [_pod(0), _pod(1)]
    texts, table = _passes(pods, _running(), (1,), [T0, T0 + 30, T0 + GRACE, T0 + GRACE + 30])
    assert texts[:2] == ["", ""]  # a trainer still importing or in rendezvous does not answer either
    assert texts[2] and "j-worker-1" in texts[2] and "10.0.0.2" in texts[2] and REFUSED in texts[2]
    assert "j-worker-0" not in texts[2] and texts[2].startswith("1 of 2 running workers")
    assert texts[3] == texts[2]  # the same text: the shell's de-duplication posts it once
    assert table == {endpoints(_spec(), pods)[1].url: T0}


def test_a_worker_that_answers_again_starts_its_grace_over() -> None:
    pods = [_pod(0), _pod(1)]
    eps, errors = _silent(pods, 1)
    table, _ = unanswered(errors, eps, pods, {}, now=T0, grace_s=GRACE, quiet="")
    table, text = unanswered({}, eps, pods, table, now=T0 + 30, grace_s=GRACE, quiet="")
    assert table == {} and text == ""
    table, text = unanswered(errors, eps, pods, table, now=T0 + GRACE + 1, grace_s=GRACE, quiet="")
    assert text == "" and table == {eps[1].url: T0 + GRACE + 1}


def test_pods_not_running_ready_or_being_deleted_are_never_a_scrape_fault() -> None:
    spec = _spec()
    running = [_pod(0), _pod(1)]
    eps = endpoints(spec, running)
    errors = {ep.url: REFUSED for ep in eps}
    for later in ([_pod(0, ready=False), _pod(1, "Pending")], [_pod(0, deleting=True), _pod(1, "Succeeded")]):
        table, text = unanswered(errors, eps, later, {ep.url: T0 for ep in eps}, now=T0 + 999, grace_s=GRACE, quiet="")
        assert (table, text) == ({}, "")


def test_expected_moments_are_quiet_and_the_grace_starts_after_them() -> None:
    spec, st = _spec(), _running()
    assert quiet_reason(st, spec, [_pod(0), _pod(1)]) == ""
    assert "1 of 2 workers ready" in quiet_reason(st, spec, [_pod(0), _pod(1, ready=False)])  # starting
    assert quiet_reason(st, spec, [_pod(0), _pod(1, deleting=True)]) == "worker pods terminating"
    assert quiet_reason(st, spec, [_pod(0), _pod(1, "Succeeded")]) == "workers exiting"  # training ended
    switching = _running()
    switching.target_mode = "async"
    assert "switching mode sync -> async" in quiet_reason(switching, spec, [_pod(0), _pod(1)])  # a switch's pause
    reached = _running()
    reached.target_step = 400
    assert "target reached" in quiet_reason(reached, spec, [_pod(0), _pod(1)])  # ranks stop at the agreed step
    done = _running()
    done.phase = Phase.SUCCEEDED
    assert quiet_reason(done, spec, [_pod(0), _pod(1)]) == "job Succeeded"

    # Every worker silent through a whole switch: no Warning, and its grace counts from the switch's end.
    pods = [_pod(0), _pod(1)]
    eps, errors = _silent(pods, 0, 1)
    table: dict[str, float] = {}
    for t in (T0, T0 + GRACE, T0 + 2 * GRACE):
        table, text = unanswered(
            errors, eps, pods, table, now=t, grace_s=GRACE, quiet=quiet_reason(switching, spec, pods)
        )
        assert (table, text) == ({}, "")
    table, text = unanswered(errors, eps, pods, table, now=T0 + 3 * GRACE, grace_s=GRACE, quiet="")
    assert text == "" and set(table.values()) == {T0 + 3 * GRACE}


def test_the_policy_state_is_never_written_to_status() -> None:
    st = _running()
    state, _ = driver_state(st)
    store(st, state)
    assert controller(st).policy_state  # the driver leaves it there during a pass
    raw = dump_status(st)
    assert raw["controller"]["policyState"] is None  # a merge patch: removes an older operator's copy
    assert "evaluations" not in json.dumps(raw)


def test_an_older_operators_policy_state_is_taken_from_status_and_kept_in_the_jobs_config_map() -> None:
    text = json.dumps(PolicyState(evaluations=41, jitter=0.25).to_dict())
    st = load_status({"phase": "Running", "controller": {"policyState": text, "command": {"epoch": 3}}})
    assert take_policy_state(st) == text and controller(st).policy_state is None
    assert controller(st).command == {"epoch": 3}  # the rest of the bookkeeping stays in status
    assert take_policy_state(st) is None  # taken once

    ref = JobRef("j", "ns", "uid-j")
    cm = build_policy_state(ref, text)
    assert cm["metadata"]["name"] == "j-policy-state" and cm["metadata"]["ownerReferences"][0]["uid"] == "uid-j"
    assert stored_policy_state(cm) == text and stored_policy_state(None) is None
    st2 = _running()
    controller(st2).policy_state = stored_policy_state(cm)
    resumed, problem = driver_state(st2)
    assert problem == "" and resumed.policy.evaluations == 41 and resumed.policy.jitter == 0.25
