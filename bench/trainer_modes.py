"""Side-by-side benchmark of the three modes on the quickstart shape, under real torchrun.

    python -m bench.trainer_modes [--steps 200] [--out DIR] [--switches]

Runs `python -m torch.distributed.run --standalone --nproc-per-node=4 -m sgdjob_trainer` once per
mode (4 workers, rank 3 emulated 3x slower, computeSeconds 0.05: EMULATED compute, real gloo
exchange), reads each rank's rank-<r>.json and prints, per mode: throughput (useful samples / wall
seconds of the slowest rank's loop), the bound (sum of per-rank samples per compute second, i.e.
each worker's speed when never waiting), efficiency = throughput / bound, and the final loss.
With --switches a fourth run starts in sync and is driven over POST /control through all six
ordered mode pairs, and the per-switch pauses are printed. The helpers here (launch, wait_status,
post_control) are also what the trainer tests use to drive real runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from sgdjob_operator.local.procs import free_port_blocks

SWITCH_SEQUENCE = ("hierarchical", "async", "sync", "async", "hierarchical", "sync")  # from sync: all 6 ordered pairs


def quickstart_config(mode: str, steps: int, port: int) -> dict[str, Any]:
    return {
        "jobName": f"bench-{mode}",
        "mode": mode,
        "referenceWorldSize": 4,
        "training": {
            "model": "mlp",
            "dataset": "synthetic",
            "batchSize": 32,
            "learningRate": 0.05,
            "steps": steps,
            "metricsPort": port,
            # Groups by speed: the three equal workers together, the straggler alone.
            "hierarchical": {"groups": [[0, 1, 2], [3]]},
            "emulation": {"computeSeconds": 0.05, "jitter": 0.05, "slowdowns": [{"rank": 3, "factor": 3.0}]},
        },
    }


def free_port_base(count: int) -> int:
    """A base port with `count` consecutive free ports above it (checked, not reserved), below the
    ephemeral range: a port the kernel may hand to any outgoing connection (gloo's, an HTTP
    client's) can be taken between this check and the trainer's bind."""
    return free_port_blocks(1, size=count)[0]


def spawned_rank_env(rank: int, world: int, port: int) -> None:
    """torchrun's environment contract for one process of a world spawned by a test on loopback
    (metrics on an ephemeral port, so runs in a row never collide)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        SGDJOB_METRICS_PORT="0",
        SGDJOB_METRICS_HOST="127.0.0.1",
    )


def launch(
    config: dict[str, Any], workdir: Path, nproc: int = 4, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start torchrun with this RunConfig; reports go to workdir/report, logs to workdir/log.txt."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "run.json"
    path.write_text(json.dumps(config))
    full_env = {
        **os.environ,
        "SGDJOB_REPORT_DIR": str(workdir / "report"),
        "SGDJOB_METRICS_HOST": "127.0.0.1",
        **(env or {}),
    }
    if "SGDJOB_METRICS_PORT" not in (env or {}):
        full_env.pop("SGDJOB_METRICS_PORT", None)  # the config's metricsPort, not an inherited one
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "sgdjob_trainer",
        "--config",
        str(path),
    ]
    log = (workdir / "log.txt").open("wb")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def post_control(port: int, body: dict[str, Any], token: str | None) -> tuple[int, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/control", data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def statuses(base_port: int, nproc: int) -> list[dict[str, Any]] | None:
    try:
        return [get_json(f"http://127.0.0.1:{base_port + r}/status") for r in range(nproc)]
    except (OSError, ValueError):
        return None


def wait_status(
    base_port: int, nproc: int, predicate: Any, timeout: float, proc: subprocess.Popen[bytes] | None = None
) -> list[dict[str, Any]]:
    """Poll every rank's /status until predicate(list of status) holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the run exited with {proc.returncode} while waiting")
        docs = statuses(base_port, nproc)
        if docs is not None and predicate(docs):
            return docs
        time.sleep(0.1)
    raise TimeoutError(f"status condition not met within {timeout} s: {statuses(base_port, nproc)}")


def read_reports(report_dir: Path, nproc: int) -> list[dict[str, Any]]:
    return [json.loads((report_dir / f"rank-{r}.json").read_text()) for r in range(nproc)]


def figures(reports: list[dict[str, Any]]) -> dict[str, float]:
    samples = sum(r["samples"] for r in reports)
    wall = max(r["wallSeconds"] for r in reports)
    bound = sum(r["speedSamplesPerS"] for r in reports)
    throughput = samples / wall
    return {
        "throughput": throughput,
        "bound": bound,
        "efficiency": throughput / bound,
        "wall_s": wall,
        "final_loss": reports[0]["finalLoss"],
        "initial_loss": reports[0]["initialLoss"],
    }


def run_mode(mode: str, steps: int, out: Path) -> dict[str, float]:
    port = free_port_base(4)
    proc = launch(quickstart_config(mode, steps, port), out / mode)
    if proc.wait(timeout=1800) != 0:
        raise RuntimeError(f"{mode} run failed; see {out / mode / 'log.txt'}")
    return figures(read_reports(out / mode / "report", 4))


def run_switches(steps: int, out: Path) -> list[dict[str, Any]]:
    port, token = free_port_base(4), "bench-token"
    config = quickstart_config("sync", steps, port)
    config["training"]["emulation"]["computeSeconds"] = 0.01
    proc = launch(config, out / "switches", env={"SGDJOB_CONTROL_TOKEN": token})
    try:
        wait_status(port, 4, lambda docs: all(d["step"] >= 5 for d in docs), 300, proc)
        for epoch, mode in enumerate(SWITCH_SEQUENCE, start=1):
            post_control(port, {"epoch": epoch, "mode": mode, "reason": f"bench switch {epoch}"}, token)
            wait_status(port, 4, lambda docs, m=mode: all(d["mode"] == m for d in docs), 120, proc)
        proc.wait(timeout=1800)
    finally:
        if proc.poll() is None:
            proc.kill()
    reports = read_reports(out / "switches" / "report", 4)
    switches = list(reports[0]["switches"])
    for i, record in enumerate(switches):
        # A rank's pause includes waiting for the others to reach the switch point: report the longest.
        record["pauseS"] = max(r["switches"][i]["pauseS"] for r in reports)
    return switches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.trainer_modes", description="Sync vs hierarchical vs async, side by side."
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("/tmp/sgdjob-bench"))
    parser.add_argument(
        "--modes", nargs="+", default=["sync", "hierarchical", "async"], choices=["sync", "hierarchical", "async"]
    )
    parser.add_argument("--switches", action="store_true", help="also measure the six switch pauses")
    args = parser.parse_args(argv)
    results = {mode: run_mode(mode, args.steps, args.out) for mode in args.modes}
    print("EMULATED compute (computeSeconds 0.05, rank 3 x3), real gloo exchange, 4 processes")
    print(f"{'mode':<13}{'samples/s':>11}{'bound':>9}{'efficiency':>12}{'vs sync':>9}{'final loss':>12}{'wall s':>8}")
    for mode, f in results.items():
        ratio = f["throughput"] / results["sync"]["throughput"] if "sync" in results else float("nan")
        print(
            f"{mode:<13}{f['throughput']:>11.1f}{f['bound']:>9.1f}{f['efficiency']:>12.3f}{ratio:>9.2f}{f['final_loss']:>12.4f}{f['wall_s']:>8.1f}"
        )
    summary: dict[str, Any] = {"modes": results}
    if args.switches:
        switches = run_switches(400, args.out)
        summary["switches"] = switches
        for s in switches:
            print(
                f"switch {s['fromMode']:>12} -> {s['toMode']:<12} at step {s['step']:>5}: "
                f"pause {s['pauseS']:.3f} s (longest rank)"
            )
    (args.out / "bench.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
