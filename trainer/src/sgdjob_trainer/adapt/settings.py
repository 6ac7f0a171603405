"""What a session takes from the job's run-config, or under plain torchrun from the script (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sgdjob_trainer.config import Adaptation, SyncMode, TrainingConfig
from sgdjob_trainer.wire.launch_contract import ENV_RUN_CONFIG, RunConfig


@dataclass(frozen=True, slots=True)
class Settings:
    """What the session takes from the job (its run-config) or, under plain torchrun, from the script."""

    managed: bool  # SGDJob started the script: control, agreed stops, the job's settings
    job_name: str
    training: TrainingConfig
    checkpoint_dir: Path | None
    checkpoint_every: int
    start_mode: SyncMode = SyncMode.SYNC  # the job's mode to start in: sync (also for auto) or async

    @property
    def adapted(self) -> bool:
        return self.managed and self.training.adaptation == Adaptation.API


def settings(config: RunConfig | None, checkpoint_dir: str | None, checkpoint_every: int | None) -> Settings:
    """The job's training.checkpoint wins over the script's arguments, which serve plain torchrun and
    a job without a checkpoint directory (pure)."""
    training = config.training if config is not None else TrainingConfig()
    job_dir = training.checkpoint.dir
    directory = job_dir if job_dir is not None else checkpoint_dir
    every = training.checkpoint.interval_steps if job_dir is not None or checkpoint_every is None else checkpoint_every
    return Settings(
        managed=config is not None,
        job_name=config.job_name if config is not None else "script",
        training=training,
        checkpoint_dir=Path(directory) if directory is not None else None,
        checkpoint_every=every,
        start_mode=config.mode if config is not None else SyncMode.SYNC,
    )


def read_run_config(env: Mapping[str, str]) -> RunConfig | None:
    path = env.get(ENV_RUN_CONFIG)
    return RunConfig.model_validate_json(Path(path).read_text()) if path else None
