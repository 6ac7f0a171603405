"""The run report: pure aggregation of the trainers' `rank-<rank>.json` files into `report.json`.

Definitions (the design's performance yardstick):
- throughput = total applied samples of all ranks / training wall time (the longest rank's
  `wallSeconds`, which starts after rendezvous, so process start-up is not charged to a mode);
- a rank's speed = its samples / its compute seconds (emulated compute included): what it would do
  if it never waited; bound = sum of the speeds; efficiency = throughput / bound.
- first_decision (auto runs) = the policy's first decision: its time since the first worker began
  training (`time_s`; None when no worker dated its start), its step, its action, and its time
  since the run began (`run_time_s`, which includes process start-up);
- restarts = how many times the workers were restarted and resumed (the control rank's restart
  history, which survives restarts in the checkpoint directory); lost_steps = steps redone after
  them (reached before the failure minus the checkpoint step resumed from). The figures cover the
  last life only: counters restart with each process.
- validation_curve = the control rank's validations on the held-out split, each at a step, seconds
  since the job began training (its first life: a restarted rank 0 continues the curve from the
  checkpoint directory) and samples: the job's applied samples by then, estimated as rank 0's own
  samples scaled by its share of the total at the end (exact when every rank has the same batch);
  time_to_target_s and target_step when the run ended because the validation reached
  `training.target` (reason TargetReached).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sgdjob_trainer.wire.worker_status import WorkerStatus

RANK_FILE_GLOB = "rank-*.json"


def _number(value: Any, default: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    return float(value)


def _num(doc: Mapping[str, Any], key: str, default: float = 0.0) -> float:
    return _number(doc.get(key), default)


def _loss(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def rank_speed(samples: float, compute_s: float) -> float:
    """Samples per second when never waiting; 0 for a rank that computed nothing (e.g. a server)."""
    return samples / compute_s if compute_s > 0 else 0.0


def per_rank_entry(doc: Mapping[str, Any]) -> dict[str, Any]:
    samples = _num(doc, "samples")
    compute = _num(doc, "computeSeconds")
    return {
        "rank": int(_num(doc, "rank", -1)),
        "node": doc.get("node"),
        "speed_samples_per_s": rank_speed(samples, compute),
        "compute_s": compute,
        "wait_s": _num(doc, "commWaitSeconds"),
        "samples": int(samples),
        "steps": int(_num(doc, "step")),
        "batch_size": int(_num(doc, "batchSize")),  # at the end: a rebalance shows here
        "wall_s": _num(doc, "wallSeconds"),
        "final_loss": _loss(doc.get("finalLoss")),
    }


def diverged(doc: Mapping[str, Any]) -> bool:
    """True when a rank's loss went non-finite (the trainer reports NaN/inf losses as null)."""
    history = doc.get("lossHistory")
    bad_history = isinstance(history, list) and any(
        isinstance(p, list) and len(p) >= 2 and _loss(p[1]) is None for p in history
    )
    return bad_history or (_loss(doc.get("initialLoss")) is not None and _loss(doc.get("finalLoss")) is None)


def mode_timeline(entries: Sequence[Mapping[str, Any]] | None, start_mode: str) -> list[dict[str, Any]]:
    """The control rank's mode timeline in report form; the first entry is always the start mode."""
    out: list[dict[str, Any]] = [
        {
            "time_s": _num(e, "timeS"),
            "step": int(_num(e, "step")),
            "mode": str(e.get("mode", "")),
            "reason": str(e.get("reason", "")),
        }
        for e in (entries or [])
        if isinstance(e, Mapping)
    ]
    out.sort(key=lambda e: (e["time_s"], e["step"]))
    if not out or (out[0]["step"] > 0 and out[0]["mode"] != start_mode):
        out.insert(0, {"time_s": 0.0, "step": 0, "mode": start_mode, "reason": "start"})
    return out


def restart_summary(control: Mapping[str, Any]) -> dict[str, Any]:
    """`restarts`, `lost_steps` and the history behind them, from the control rank's report."""
    raw = control.get("resumes")
    resumes = [r for r in raw if isinstance(r, Mapping)] if isinstance(raw, list) else []
    checkpoint = control.get("checkpoint")
    return {
        "restarts": len(resumes),
        "lost_steps": int(sum(_num(r, "lostSteps") for r in resumes)),
        "resumes": [dict(r) for r in resumes],
        "checkpoint": dict(checkpoint) if isinstance(checkpoint, Mapping) else None,
    }


def first_decision(decisions: Sequence[Mapping[str, Any]], training_start_s: float | None) -> dict[str, Any] | None:
    """The first of an auto run's recorded decisions, timed from the training start (pure)."""
    if not decisions:
        return None
    first = decisions[0]
    run_time = _num(first, "time_s")
    since_start = round(run_time - training_start_s, 3) if training_start_s is not None else None
    return {
        "time_s": since_start,
        "step": int(_num(first, "step")),
        "action": first.get("action"),
        "run_time_s": run_time,
    }


def validation_summary(control: Mapping[str, Any], total_samples: int) -> dict[str, Any]:
    """The validation curve, the latest figures and the target's outcome, from the control rank's report."""
    raw = control.get("validationHistory")
    points = [p for p in raw if isinstance(p, list) and len(p) >= 5] if isinstance(raw, list) else []
    own = _num(control, "samples")
    scale = total_samples / own if own > 0 else 0.0
    curve = [
        {
            "step": int(_number(p[0])),
            "time_s": _number(p[3]),
            "samples": round(_number(p[4]) * scale),
            "loss": _loss(p[1]),
            "accuracy": _loss(p[2]),
            "metric": _loss(p[5]) if len(p) > 5 else None,
        }
        for p in points
    ]
    reason = control.get("endReason")
    return {
        "validation": {
            "step": control.get("validationStep"),
            "loss": _loss(control.get("validationLoss")),
            "accuracy": _loss(control.get("validationAccuracy")),
            "metric": _loss(control.get("validationMetric")),
        },
        "validation_curve": curve,
        "reason": reason if isinstance(reason, str) else None,
        "time_to_target_s": _loss(control.get("timeToTargetS")),
        "target_step": control.get("targetStep"),
    }


def build_report(
    rank_docs: Sequence[Mapping[str, Any]],
    *,
    job: str,
    mode: str,
    expected_workers: int,
    emulation: Mapping[str, Any] | None,
    fallback_wall_s: float | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Aggregate rank reports into the run report. Missing ranks are listed, never invented."""
    docs = sorted(rank_docs, key=lambda d: _num(d, "rank", -1))
    per_rank = [per_rank_entry(d) for d in docs]
    walls = [r["wall_s"] for r in per_rank if r["wall_s"] > 0]
    wall = max(walls) if walls else (fallback_wall_s or 0.0)
    total_samples = sum(r["samples"] for r in per_rank)
    throughput = total_samples / wall if wall > 0 else 0.0
    bound = sum(r["speed_samples_per_s"] for r in per_rank)
    control = next((d for d in docs if _num(d, "rank", -1) == 0), docs[0] if docs else {})
    seen = {r["rank"] for r in per_rank}
    raw_switches = control.get("switches")
    switches: list[Any] = raw_switches if isinstance(raw_switches, list) else []
    report: dict[str, Any] = {
        "job": job,
        "mode": mode,
        "workers": len(per_rank),
        "expected_workers": expected_workers,
        "missing_ranks": [r for r in range(expected_workers) if r not in seen],
        "wall_s": wall,
        "throughput_samples_per_s": throughput,
        "bound_samples_per_s": bound,
        "efficiency": throughput / bound if bound > 0 else 0.0,
        "samples": total_samples,
        "steps": max((r["steps"] for r in per_rank), default=0),
        "initial_loss": _mean([_loss(d.get("initialLoss")) for d in docs]),
        "final_loss": _mean([_loss(d.get("finalLoss")) for d in docs]),
        "diverged_ranks": [int(_num(d, "rank", -1)) for d in docs if diverged(d)],
        "ranks_from_last_status": [int(_num(d, "rank", -1)) for d in docs if d.get("fromStatus")],
        "mode_timeline": mode_timeline(control.get("modeTimeline"), mode),
        "switches": len(switches),
        "switch_pause_s": sum((_num(s, "pauseS") for s in switches if isinstance(s, Mapping)), 0.0),
        "per_rank": per_rank,
        "loss_history": control.get("lossHistory") or [],
        "emulation": dict(emulation) if emulation is not None else None,
        **restart_summary(control),
        **validation_summary(control, total_samples),
    }
    if extra:
        report.update(extra)
    decisions = report.get("decisions")
    if isinstance(decisions, list):
        start = report.get("training_start_s")
        report["first_decision"] = first_decision(decisions, start if isinstance(start, int | float) else None)
    return report


def with_status_fallback(
    rank_docs: Sequence[Mapping[str, Any]],
    statuses: Mapping[int, WorkerStatus],
) -> list[dict[str, Any]]:
    """Rank files, plus the last /status of each rank that wrote none (a run stopped by a signal or
    a crash): its counters up to that poll, wall time from its own clocks, `fromStatus` set."""
    docs = [dict(d) for d in rank_docs]
    have = {int(_num(d, "rank", -1)) for d in docs}
    for rank, status in sorted(statuses.items()):
        if rank in have:
            continue
        doc = status.document()
        doc.update(fromStatus=True, finalLoss=_loss(status.loss))
        if status.time > 0 and status.start_time > 0:
            doc["wallSeconds"] = status.time - status.start_time
        docs.append(doc)
    return docs


def load_rank_docs(report_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Read every rank file of a run; unreadable files are returned as problems, not raised."""
    docs: list[dict[str, Any]] = []
    problems: list[str] = []
    for path in sorted(report_dir.glob(RANK_FILE_GLOB)):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            problems.append(f"{path.name}: {err}")
            continue
        if isinstance(doc, dict):
            docs.append(doc)
        else:
            problems.append(f"{path.name}: not a JSON object")
    return docs, problems


def final_world(docs: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], int | None]:
    """The rank files of the run's last world and its size, which rank 0's file states (rank 0 is in
    every world, and each world's ranks rewrite their files): a rank that a shrink removed leaves a
    file of the world before, which is dropped. Every file and None when rank 0 wrote none."""
    world = next((int(_num(d, "worldSize")) for d in docs if int(_num(d, "rank", -1)) == 0), 0)
    if world <= 0:
        return list(docs), None
    return [d for d in docs if 0 <= int(_num(d, "rank", -1)) < world], world


def summary_lines(report: Mapping[str, Any]) -> list[str]:
    """A few plain lines for the end of a run."""

    def fmt(value: Any, spec: str) -> str:
        return format(value, spec) if isinstance(value, int | float) else "n/a"

    emulation = report.get("emulation")
    lines = [
        (
            f"mode {report.get('mode')}  workers {report.get('workers')}  steps {report.get('steps')}  "
            f"wall {fmt(report.get('wall_s'), '.1f')}s"
        ),
        f"throughput {fmt(report.get('throughput_samples_per_s'), '.1f')} samples/s  "
        f"bound {fmt(report.get('bound_samples_per_s'), '.1f')} samples/s  "
        f"efficiency {fmt(report.get('efficiency'), '.2f')}",
        f"loss {fmt(report.get('initial_loss'), '.4f')} -> {fmt(report.get('final_loss'), '.4f')}"
        + (
            f"  (DIVERGED: non-finite loss on ranks {report['diverged_ranks']})" if report.get("diverged_ranks") else ""
        ),
        "emulation: " + (json.dumps(emulation, sort_keys=True) if emulation else "none (real compute)"),
    ]
    cpu = report.get("cpu_limits")
    if isinstance(cpu, Mapping):
        limited = ", ".join(f"{node} {v['cpus']:g} CPU" for node, v in cpu.get("by_node", {}).items())
        lines.append(f"cpu limits: {limited} ({cpu.get('kind')}, cgroup v{cpu.get('cgroup_version')})")
    for r in report.get("per_rank", []):
        lines.append(
            f"  rank {r['rank']} ({r['node']}): {r['speed_samples_per_s']:.1f} samples/s when busy, "
            f"compute {r['compute_s']:.1f}s wait {r['wait_s']:.1f}s, {r['samples']} samples in {r['steps']} steps"
        )
    first = report.get("first_decision")
    if isinstance(first, Mapping):
        since = f"{fmt(first.get('time_s'), '.1f')}s after training began"
        lines.append(f"first decision: {first.get('action')} at step {first.get('step')}, {since}")
    validation = report.get("validation") or {}
    if validation.get("loss") is not None:
        accuracy = validation.get("accuracy")
        lines.append(
            f"validation at step {validation.get('step')}: loss {fmt(validation.get('loss'), '.4f')}"
            + (f"  accuracy {accuracy:.3f}" if isinstance(accuracy, float) else "")
        )
    if report.get("time_to_target_s") is not None:
        lines.append(
            f"target reached at step {report.get('target_step')} after {fmt(report['time_to_target_s'], '.1f')}s"
        )
    if report.get("restarts"):
        lines.append(
            f"restarts {report['restarts']} (resumed from checkpoints), steps redone {report.get('lost_steps')}"
        )
    ckpt = report.get("checkpoint") or {}
    if ckpt.get("failed"):
        lines.append(
            f"checkpoint writes failed: {ckpt['failed']} (last, of step {ckpt.get('lastErrorStep')}: "
            f"{ckpt.get('lastError')}); check training.checkpoint.dir's volume"
        )
    for death in report.get("agent_deaths") or []:
        recovered = death.get("recovery_s")
        lines.append(
            f"agent {death.get('node')} died at {fmt(death.get('time_s'), '.1f')}s ({death.get('exit')}): "
            f"{death.get('action')}, {death.get('lost_steps')} steps lost"
            + (f", recovered in {recovered:.1f}s" if isinstance(recovered, float | int) else "")
        )
    if report.get("missing_ranks"):
        lines.append(f"missing rank reports: {report['missing_ranks']}")
    return lines
