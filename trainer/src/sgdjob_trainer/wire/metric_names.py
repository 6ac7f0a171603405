"""The Prometheus names a trainer exports on /metrics and its controllers parse.

The trainer registers its metrics under these family names; the scraper reads the samples under
`sample_name` of them. A name changed here changes on both sides at once.
"""

from __future__ import annotations

# Counters: cumulative since the process started (a restart resets them).
STEPS = "sgdjob_steps"
SAMPLES = "sgdjob_samples"
COMPUTE_SECONDS = "sgdjob_compute_seconds"
COMM_WAIT_SECONDS = "sgdjob_comm_wait_seconds"
SWITCHES = "sgdjob_switches"
SWITCH_PAUSE_SECONDS = "sgdjob_switch_pause_seconds"
VALIDATION_SECONDS = "sgdjob_validation_seconds"  # rank 0's evaluation time, neither compute nor wait

# Histogram of wall seconds per step.
STEP_SECONDS = "sgdjob_step_seconds"

# Gauges.
LOSS = "sgdjob_loss"
STALENESS = "sgdjob_staleness_steps"
WORLD_SIZE = "sgdjob_world_size"
BATCH_SIZE = "sgdjob_batch_size"
CONTROL_EPOCH = "sgdjob_control_epoch"
GRADIENT_BYTES = "sgdjob_gradient_bytes"
# Seconds this process has trained, on its own clock, as of the scrape (NaN before its first step
# began). With it a controller dates the counters' zero in its own clock, with no clock shared.
TRAINING_SECONDS = "sgdjob_training_seconds"
# Moving averages over the steps of the current mode (see sgdjob_trainer.gradient_stats): |G|^2, the
# per-sample gradient variance tr(S), <G_t, G_t-1>, and how many steps they average (NaN: not yet).
GRADIENT_SQ_NORM = "sgdjob_gradient_sq_norm"
GRADIENT_VARIANCE = "sgdjob_gradient_variance"
GRADIENT_LAG_DOT = "sgdjob_gradient_lag_dot"
GRADIENT_STAT_STEPS = "sgdjob_gradient_stat_steps"
# Hang signals: seconds since the process last finished a step, and 1 while it is inside a step's own
# compute (a rank stuck there while the others wait in an exchange is the one that hangs).
STALLED_SECONDS = "sgdjob_stalled_seconds"
COMPUTING = "sgdjob_computing"
# 0 when the job's optimizer keeps state async mode cannot shard (optim.async_obstacle): the policy
# then never proposes async. 1 otherwise (as far as is known yet).
ASYNC_CAPABLE = "sgdjob_async_capable"
# 0 when the process cannot run hierarchical mode (a script on the adaptation API that gave adapt.start
# no optimizer, or whose DDP model would tie the groups together: adapt.hierarchy.obstacle): the
# policy then never proposes hierarchical. 1 otherwise (SGDJob's own trainer always).
HIERARCHICAL_CAPABLE = "sgdjob_hierarchical_capable"
# 1 when the job's optimizer normalises its steps by the gradients' running root-mean-square (Adam,
# RMSprop, Adagrad; optim.adaptive). Its step then shrinks as an update's gradient gets noisier, so
# the policy weighs an update over fewer samples (one async worker's, one group's) by the measured
# gradient noise scale as well as by its staleness (policy.efficiency).
ADAPTIVE = "sgdjob_optimizer_adaptive"
MODE = "sgdjob_mode"  # one series per mode, labelled LABEL_MODE: 1 for the active one
VALIDATION_LOSS = "sgdjob_validation_loss"  # rank 0: loss on the held-out split at the last validation
VALIDATION_ACCURACY = "sgdjob_validation_accuracy"  # rank 0, classification only: fraction right (0..1)
VALIDATION_METRIC = "sgdjob_validation_metric"  # rank 0, with training.evaluation.metric: its value
WORKER_INFO = "sgdjob_worker_info"  # always 1, labelled with the process's identity

LABEL_MODE = "mode"
LABEL_RANK = "rank"
LABEL_LOCAL_RANK = "local_rank"
LABEL_NODE = "node"
WORKER_INFO_LABELS = (LABEL_RANK, LABEL_LOCAL_RANK, LABEL_NODE)

COUNTERS = frozenset(
    {STEPS, SAMPLES, COMPUTE_SECONDS, COMM_WAIT_SECONDS, SWITCHES, SWITCH_PAUSE_SECONDS, VALIDATION_SECONDS}
)


def sample_name(family: str) -> str:
    """The name a family's value is exposed under: prometheus_client appends `_total` to counters
    (histograms expose `_bucket`/`_sum`/`_count`, which no controller reads)."""
    return f"{family}_total" if family in COUNTERS else family
