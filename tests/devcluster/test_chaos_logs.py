"""The chaos suite keeps what a flake needs: the log tails of the pods whose failure the operator counted
(e2e/chaos.counted_failures), found by the names in the operator's own Event text."""

from __future__ import annotations

from e2e.chaos import counted_failures, stop_lines
from sgdjob_operator.k8s.builders import ROLE_RDZV, ROLE_WORKER
from sgdjob_operator.k8s.failures import classify
from sgdjob_operator.k8s.status import PodView


def _pod(name: str, exit_code: int) -> PodView:
    return PodView(name, "u-" + name, ROLE_WORKER, 3, "Failed", False, "10.0.0.3", "n1", False, exit_code, "Error")


def test_a_counted_failure_brings_its_own_log_and_no_other() -> None:
    store = PodView("j-rdzv", "u-r", ROLE_RDZV, None, "Running", True, "10.0.0.9", "n2", False)
    verdict = classify(_pod("j-worker-3", 1), [store], {})
    assert verdict.counted, verdict
    logs = {
        "/x/log/pods/ns_j-worker-3_u1/worker/0.log": "\n".join(f"line {i}" for i in range(100)) + "\nTraceback: boom",
        "/x/log/pods/ns_j-worker-30_u2/worker/0.log": "another pod's life",
        "/x/log/pods/ns_j-worker-1_u3/worker/0.log": "a healthy peer",
    }
    text = counted_failures(logs, [f"WorkerFailed: {verdict.cause}", "Rescaled: 4 workers"])
    assert "Traceback: boom" in text and "line 99" in text and "line 10\n" not in text, text
    assert "another pod's life" not in text and "a healthy peer" not in text
    assert "no kept log" in counted_failures({}, [f"WorkerFailed: {verdict.cause}"])


def test_steps_lost_bring_each_lives_stops_and_resumes() -> None:
    logs = {
        "/n1/log/pods/ns_j-worker-0_u1/worker/0.log": "step 10\nstopped at the agreed step 3061 after a checkpoint\n",
        "/n2/log/pods/ns_j-worker-0_u2/worker/0.log": "restart: 59 steps lost (reached 3061, resumed at 3002)\nloss 1",
    }
    text = stop_lines(logs)
    assert text.splitlines() == [
        "ns_j-worker-0_u1/worker/0.log: stopped at the agreed step 3061 after a checkpoint",
        "ns_j-worker-0_u2/worker/0.log: restart: 59 steps lost (reached 3061, resumed at 3002)",
    ]
