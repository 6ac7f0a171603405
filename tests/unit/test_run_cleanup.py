"""`sgdjob run`'s clean-up (local.runner.CleanUp): every step runs, and no error is lost."""

from __future__ import annotations

import pytest

from sgdjob_operator.local.runner import CleanUp


def test_every_step_runs_and_the_first_error_surfaces() -> None:
    clean, ran = CleanUp(), []
    with clean.step():
        raise BrokenPipeError("the display's stream is closed")
    with clean.step():
        ran.append("stop the workers")
    with clean.step():
        ran.append("remove the cgroups")
        raise PermissionError("a later failure")
    with pytest.raises(BrokenPipeError, match="stream is closed"):
        clean.done(None)
    assert ran == ["stop the workers", "remove the cgroups"]


def test_a_run_already_failing_keeps_its_error_and_is_told_of_the_clean_ups() -> None:
    clean = CleanUp()
    with clean.step():
        raise BrokenPipeError("stream closed")
    ending = RuntimeError("the run's own failure")
    clean.done(ending)  # not raised over the run's error, which the caller is raising
    assert ending.__notes__ == ["and cleaning up after it failed too: BrokenPipeError('stream closed')"]


def test_nothing_to_report_when_every_step_succeeds() -> None:
    clean = CleanUp()
    with clean.step():
        pass
    clean.done(None)
