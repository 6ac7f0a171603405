"""A checkpoint volume with no space left (issue #38's chaos list): every write fails with ENOSPC, training
goes on, the run succeeds, and the failures are named where a user looks (report.json's checkpoint
figures, the summary line) instead of only in a rank's log. Real trainers on a real, full tmpfs."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.local.example_runs import RunExample

pytestmark = pytest.mark.multiproc


@pytest.fixture
def full_volume(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "ckpt-volume"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.decode().strip()}")
    try:
        # Full to the last page: the directory's claim, the shared-volume check and rank 0's progress
        # file fail as well as every checkpoint, from the first start on.
        with open(mount / "filler", "wb", buffering=0) as out:
            try:
                while True:
                    out.write(b"\0" * 4096)
            except OSError:
                pass
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_checkpoint_volume_is_reported_and_training_goes_on(
    run_example: RunExample, full_volume: Path, tmp_path: Path
) -> None:
    # `sgdjob run` checkpoints into its own output folder (out/checkpoints): that is the full volume here.
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "checkpoints").symlink_to(full_volume)
    code, output, report, _ = run_example(
        "quickstart.yaml",
        {
            "replicas": 2,
            "minReplicas": 2,
            "maxReplicas": 2,
            "mode": "sync",
            "training": {
                "steps": 120,
                "evaluation": {"everySteps": 60},
                "checkpoint": {"intervalSteps": 30},
                "emulation": {"computeSeconds": 0.01, "slowdowns": []},
            },
        },
    )
    assert code == 0 and report is not None, output[-3000:]
    assert report["ok"] and report["steps"] == 120, report
    ckpt = report["checkpoint"]
    assert ckpt["failed"] >= 3 and ckpt["completed"] == [], ckpt
    assert "No space left on device" in ckpt["lastError"], ckpt
    assert "checkpoint writes failed:" in output and "No space left on device" in output, output[-3000:]
    # A failed write leaves no partial data behind to hold space (a late rank's failure marker may stay
    # in an empty directory of the last step).
    left = [p for p in full_volume.glob(".tmp-step-*/*") if not p.name.endswith(".failed")]
    assert left == [], left
