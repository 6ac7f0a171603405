"""Which agents a reconcile pass names departed to the store (`k8s.probes.departing_agents`): the running
worker pods it deletes on purpose. Their peers then re-form the world at once; a lost node's pod is
left to its heartbeats, since the node may return with the pod still running."""

from __future__ import annotations

from sgdjob_operator.k8s.probes import departing_agents
from sgdjob_operator.k8s.status import PodView


def _pod(
    index: int | None, *, role: str = "worker", phase: str = "Running", node: str = "n", deleting: bool = False
) -> PodView:
    name = f"j-worker-{index}" if role == "worker" else "j-rdzv"
    return PodView(name, f"uid-{index}", role, index, phase, True, "10.0.0.1", node, deleting)


def test_a_rescale_or_replacement_names_the_running_pods_it_deletes() -> None:
    pods = [_pod(0), _pod(1), _pod(2, node="slow")]
    assert departing_agents(pods, {"j-worker-2"}, lost=()) == ["uid-2"]
    assert departing_agents(pods, {"j-worker-1", "j-worker-2"}, lost=()) == ["uid-1", "uid-2"]
    assert departing_agents(pods, set(), lost=()) == []


def test_lost_nodes_finished_or_already_deleting_pods_and_the_store_are_not_named() -> None:
    pods = [
        _pod(0, node="gone"),  # on a lost node: it may come back running; its heartbeats decide
        _pod(1, phase="Failed"),  # its agent is gone already
        _pod(2, deleting=True),  # named in the pass that deleted it
        _pod(3, phase="Pending"),  # never joined a round
        _pod(None, role="rdzv"),
    ]
    deleting = {p.name for p in pods}
    assert departing_agents(pods, deleting, lost={"gone"}) == []
