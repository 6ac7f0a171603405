"""The local shell: `sgdjob run job.yaml` runs an SGDJob's workers as processes on this machine."""
