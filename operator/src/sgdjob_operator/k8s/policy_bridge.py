"""The operator's bridge to the policy core: status + one scrape -> `policy.evaluate` -> decision,
health and the state to store. Pure, and it never raises: a policy failure becomes a `keep` with the
problem reported, so a bug in one job's evaluation cannot stop the operator reconciling it."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from sgdjob_operator.api.models import SGDJobSpec, SGDJobStatus
from sgdjob_operator.k8s.observe import Observation, command_fields
from sgdjob_operator.k8s.status import controller
from sgdjob_operator.policy import Keep, PolicyState, evaluate, job_view
from sgdjob_operator.policy.job import SYNC_MODES


def active_mode(st: SGDJobStatus, spec: SGDJobSpec, obs: Observation) -> str:
    for mode in (obs.mode, st.mode, st.target_mode):
        if mode in SYNC_MODES:
            return str(mode)
    return spec.initial_mode.value


def world_replicas(spec: SGDJobSpec, obs: Observation) -> int:
    """Worker pods in the running world: what the trainers report, else what the spec asks."""
    sizes = [s.world_size for s in obs.samples if s.world_size > 0]
    if sizes:
        return max(1, max(sizes) // spec.nproc_per_node)
    return spec.replicas


def run_policy(spec: SGDJobSpec, st: SGDJobStatus, obs: Observation, now: float) -> tuple[Any, Any | None, str | None, str]:
    """(decision, health or None, new policy state as JSON text or None to keep the old, problem text)."""
    try:
        state = PolicyState.from_dict(_load(controller(st).policy_state))
    except ValueError as err:
        state, problem = PolicyState(), f"stored policy state dropped: {err}"
    else:
        problem = ""
    try:
        sizes, groups = command_fields(st)
        view = job_view(spec, mode=active_mode(st, spec, obs), replicas=world_replicas(spec, obs), batch_sizes=sizes, groups=groups)
        result = evaluate(state, obs.samples, view, now)
    except Exception as err:  # the policy is pure code; any bug in it is reported, never fatal
        return Keep(f"policy error: {err}"), None, None, f"policy evaluation failed: {type(err).__name__}: {err}"
    return result.decision, result.health, json.dumps(result.state.to_dict(), separators=(",", ":")), problem


def _load(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    data = json.loads(text)  # ValueError on garbage: the caller starts afresh
    if not isinstance(data, dict):
        raise ValueError("policy state is not a JSON object")
    return data


def without_change(state: str | None, previous: str | None) -> str | None:
    """The new state with the previous `lastChange`: for a decision the operator deferred, so the
    policy's cooldown does not start for a change that was not made."""
    if state is None:
        return None
    try:
        old = PolicyState.from_dict(_load(previous))
        new = PolicyState.from_dict(_load(state))
    except ValueError:
        return state
    return json.dumps(dataclasses.replace(new, last_change=old.last_change).to_dict(), separators=(",", ":"))
