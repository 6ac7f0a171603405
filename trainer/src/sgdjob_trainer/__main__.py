"""`python -m sgdjob_trainer --config FILE`: read a RunConfig (YAML or JSON, camelCase), train, exit 0.

Meant to run under torchrun, e.g.
  torchrun --nnodes=1:4 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \\
      -m sgdjob_trainer --config run.yaml
Environment: torchrun's RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
MASTER_PORT, TORCHELASTIC_RESTART_COUNT; NODE_NAME; SGDJOB_METRICS_PORT, SGDJOB_METRICS_HOST,
SGDJOB_CONTROL_TOKEN or SGDJOB_CONTROL_TOKEN_FILE, SGDJOB_REPORT_DIR.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from sgdjob_trainer.config import RunConfig
from sgdjob_trainer.trainer import Trainer


def load_run_config(path: Path) -> RunConfig:
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    return RunConfig.model_validate(data or {})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sgdjob_trainer", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--config", required=True, type=Path, help="RunConfig file (YAML or JSON)")
    args = parser.parse_args(argv)
    trainer = Trainer(load_run_config(args.config))
    try:
        trainer.train()
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
