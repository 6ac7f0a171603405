"""Talking to running trainers, for every shell: scrape `/metrics` and `/status`, push `/control`."""
