"""Policy core: pure functions from worker samples to job health and decisions. No I/O, no clock."""
