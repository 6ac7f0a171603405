"""The text: the standard library's own top-level `.py` files, which every Python installation carries
(nothing to download). Bytes are the tokens: ASCII keeps its code, every other byte becomes UNKNOWN.

The split is by file, not by position: every HOLDOUT_EVERY-th file (by sorted name) is held out, so
validation measures how the model does on source it has never seen a line of, not on the unseen
halves of files it trained on. Both sides are capped (TRAIN_CHARS, VALIDATION_CHARS) so that every
rank builds its data in well under a second and holds a few MB. The files, and so the figures,
depend on the Python version (3.11's library here); within one job every rank runs the same image.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset

VOCAB_SIZE = 128
UNKNOWN = 0  # NUL never occurs in source text, so it is free to stand for every non-ASCII byte
CONTEXT = 64
HOLDOUT_EVERY = 10
TRAIN_CHARS = 2_000_000
VALIDATION_CHARS = 256_000
VALIDATION_ORDER_SEED = 1234


def library_dir() -> Path:
    return Path(os.__file__).parent


def source_files(root: Path | None = None) -> list[Path]:
    """The top-level `.py` files of `root` (the standard library by default), sorted by name."""
    return sorted((root or library_dir()).glob("*.py"), key=lambda p: p.name)


def split_files(files: Sequence[Path]) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): file i is held out when i % HOLDOUT_EVERY == 0."""
    train = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY != 0]
    held_out = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY == 0]
    return train, held_out


def read_text(files: Sequence[Path], limit: int) -> bytes:
    """The files' bytes, concatenated in order, cut at `limit` bytes."""
    parts: list[bytes] = []
    size = 0
    for path in files:
        if size >= limit:
            break
        data = path.read_bytes()[: limit - size]
        parts.append(data)
        size += len(data)
    return b"".join(parts)


def encode(text: bytes) -> torch.Tensor:
    """Token ids (int64): a byte's own value below VOCAB_SIZE, else UNKNOWN."""
    if not text:
        return torch.zeros(0, dtype=torch.long)
    ids = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    ids[ids >= VOCAB_SIZE] = UNKNOWN
    return ids


def decode(ids: torch.Tensor) -> str:
    return bytes(ids.tolist()).decode("ascii")


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Consecutive, non-overlapping windows of `context` tokens (stride = context); item i is
    (tokens, the next token at every position). With `shuffle_seed`, items come in a fixed random
    order, so that any first k of them (what SGDJob validates on) sample the whole text."""

    def __init__(self, ids: torch.Tensor, context: int = CONTEXT, *, shuffle_seed: int | None = None) -> None:
        if ids.dim() != 1 or ids.numel() < context + 1:
            raise ValueError(f"need a 1-D tensor of at least {context + 1} token ids, got shape {tuple(ids.shape)}")
        self.ids = ids
        self.context = context
        count = (ids.numel() - 1) // context
        self.order: torch.Tensor | None = None
        if shuffle_seed is not None:
            self.order = torch.randperm(count, generator=torch.Generator().manual_seed(shuffle_seed))
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.count:
            raise IndexError(f"window {index} out of range (0..{self.count - 1})")
        window = int(self.order[index]) if self.order is not None else index
        start = window * self.context
        chunk = self.ids[start : start + self.context + 1]
        return chunk[:-1], chunk[1:]


def train_and_validation(root: Path | None = None, context: int = CONTEXT) -> tuple[Windows, Windows]:
    """The training windows (training files) and the validation windows (held-out files, shuffled)."""
    train_files, held_out = split_files(source_files(root))
    train = Windows(encode(read_text(train_files, TRAIN_CHARS)), context)
    validation = Windows(encode(read_text(held_out, VALIDATION_CHARS)), context, shuffle_seed=VALIDATION_ORDER_SEED)
    return train, validation
