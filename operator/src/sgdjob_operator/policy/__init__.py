"""Policy core: pure functions from worker samples to job health and decisions. No I/O, no clock.

`evaluate(state, samples, job, now)` is one policy step on a `JobView` from `job_view(spec, ...)`.
The shells do not call it themselves: they call `driver.drive` once per policy interval, carry
out the `Action` it returns through their `driver.Actuator` and keep its `DriverState`.
"""

from sgdjob_operator.policy.comm import CommModel
from sgdjob_operator.policy.cost import Prediction
from sgdjob_operator.policy.decisions import Decision, Keep, Rebalance, ReplaceWorker, Rescale, SwitchMode
from sgdjob_operator.policy.engine import Evaluation, evaluate
from sgdjob_operator.policy.health import JobHealth, RankHealth, Shape
from sgdjob_operator.policy.job import JobView, job_view
from sgdjob_operator.policy.samples import WorkerSample
from sgdjob_operator.policy.state import PolicyState, RankState

__all__ = [
    "CommModel",
    "Decision",
    "Evaluation",
    "JobHealth",
    "JobView",
    "Keep",
    "PolicyState",
    "Prediction",
    "RankHealth",
    "RankState",
    "Rebalance",
    "ReplaceWorker",
    "Rescale",
    "Shape",
    "SwitchMode",
    "WorkerSample",
    "evaluate",
    "job_view",
]
