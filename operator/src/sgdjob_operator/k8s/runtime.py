"""What the operator's handlers share for its lifetime: settings, the API client, the scrape session,
and soft memory (timing, de-duplication, pod expectations). Losing it on a restart changes nothing that
matters: every pass recomputes the job's state from the API."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from sgdjob_operator.k8s import metrics
from sgdjob_operator.k8s.builders import JobRef
from sgdjob_operator.k8s.client import Kube
from sgdjob_operator.k8s.settings import OperatorSettings
from sgdjob_operator.k8s.status import PodView, pod_changed

Key = tuple[str, str]


@dataclass(slots=True)
class Runtime:
    """What the handlers share: settings, the API client, the scrape session and soft memory."""

    settings: OperatorSettings
    kube: Kube
    http: aiohttp.ClientSession
    wakeups: dict[Key, asyncio.Event] = field(default_factory=dict)
    loops: dict[Key, asyncio.Task[None]] = field(default_factory=dict)
    generations: dict[Key, int] = field(default_factory=dict)
    phases: dict[Key, str] = field(default_factory=dict)
    tokens: dict[str, str] = field(default_factory=dict)
    next_monitor: dict[str, float] = field(default_factory=dict)
    last_ensure: dict[str, float] = field(default_factory=dict)
    ensured_generation: dict[str, int] = field(default_factory=dict)
    noisy: dict[tuple[str, str], str] = field(default_factory=dict)
    # Per job UID: endpoint URL -> when its failed scrapes in a row began (lost on restart: the
    # grace then starts over, which only delays a Warning).
    failing_since: dict[str, dict[str, float]] = field(default_factory=dict)
    # Pod UID -> what a pass reads of it, last seen in a watch event: only a change wakes the job
    # (a scheduler's or kubelet's status updates that change none of it cost a pass each otherwise).
    pod_views: dict[str, PodView] = field(default_factory=dict)
    # (namespace, name) of pods a pass is creating, until their ADDED event comes.
    expected_pods: set[tuple[str, str]] = field(default_factory=set)

    def wake(self, key: Key) -> None:
        event = self.wakeups.get(key)
        if event is not None:
            event.set()

    def pod_changed(self, event_type: str, pod: dict[str, Any]) -> bool:
        """Whether a pod watch event should wake its job: not for a pod a pass has just created
        (its ADDED event can come before the create call returns: an expectation, as Kubernetes'
        own ReplicaSet controller keeps), nor for a change of nothing a pass reads."""
        changed = pod_changed(self.pod_views, event_type, pod)
        meta = pod.get("metadata") or {}
        expected = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        if expected in self.expected_pods:
            # Any event of it (ADDED, or a re-list's after a watch restart) means the cache has it.
            self.expected_pods.discard(expected)
            if event_type == "ADDED":
                return False
        return changed

    def awaits_pods(self, ref: JobRef) -> bool:
        """Whether pods a pass created for this job (or for one whose name starts alike: a harmless
        extra quorum read) have not yet shown up in a watch event."""
        prefix = f"{ref.name}-"
        return any(ns == ref.namespace and name.startswith(prefix) for ns, name in self.expected_pods)

    def forget(self, key: Key, uid: str) -> None:
        metrics.forget_job(*key)
        for table in (self.wakeups, self.generations, self.phases):
            table.pop(key, None)
        for uid_table in (
            self.tokens,
            self.next_monitor,
            self.last_ensure,
            self.ensured_generation,
            self.failing_since,
        ):
            uid_table.pop(uid, None)
        metrics.set_phases(self.phases.values())
