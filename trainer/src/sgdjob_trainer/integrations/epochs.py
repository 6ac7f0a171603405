"""The session's loader as a framework's training loop counts it (shared by the integrations)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sgdjob_trainer.adapt.loader import AdaptiveLoader


class WholeEpochs:
    """`len` is a whole epoch's steps (samples // global batch, the same under any split), so the
    framework's step and epoch counts do not shrink when the world resumes mid-epoch; iterating
    yields what is left of the loader's epoch. `dataset` is the script's (the frameworks read it)."""

    def __init__(self, loader: AdaptiveLoader, dataset: Any) -> None:
        self.loader, self.dataset = loader, dataset

    def __len__(self) -> int:
        return max(1, self.loader.samples // self.loader.split.total)

    def __iter__(self) -> Iterator[Any]:
        if len(self.loader) == 0:  # the loop took the epoch's last batch without asking for more: end it
            for _ in self.loader:
                break
        yield from self.loader
