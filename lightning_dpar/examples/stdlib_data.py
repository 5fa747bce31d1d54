"""Real text that every Python install has: the standard library's own `.py` sources, read as bytes.

Files are read in sorted path order (deterministic on a given Python install), concatenated, and cut into
non-overlapping windows of `block_size + 1` bytes (input plus next-byte targets). The last `val_fraction` of the
bytes is the validation split, so no window straddles train and validation.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

__all__ = [
    "StdlibBytes",
]

#: Directories skipped: third-party packages and generated caches are not part of the standard library.
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_source_bytes(max_bytes: int, root: str | None = None) -> bytes:
    """Up to `max_bytes` of the standard library's `.py` sources, files in sorted relative-path order."""
    root_path = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root_path.rglob("*.py") if not _SKIPPED_DIRS.intersection(p.relative_to(root_path).parts))
    chunks, total = [], 0
    for path in files:
        if total >= max_bytes:
            break
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
    data = b"".join(chunks)[:max_bytes]
    if not data:
        raise FileNotFoundError(f"No Python sources found under {str(root_path)!r} to train on.")
    return data


class ByteWindows(Dataset):
    """Non-overlapping `length`-byte windows of a byte string, as int64 token ids (0-255)."""

    def __init__(self, data: bytes, length: int) -> None:
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.windows = tokens[: len(tokens) // length * length].view(-1, length)
        if len(self.windows) == 0:
            raise ValueError(f"{len(data)} bytes are fewer than one window of {length}; use more data.")

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.windows[index].long()


class StdlibBytes(L.LightningDataModule):
    """Next-byte prediction on the Python standard library's sources.

    Args:
        block_size: tokens per sample (each sample holds `block_size + 1` bytes).
        batch_size: samples per data-parallel rank and step.
        max_bytes: how much of the standard library to read (smaller starts faster).
        val_fraction: share of the bytes held out for validation.
        root: directory to read instead of the running interpreter's standard library.
    """

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 8,
        max_bytes: int = 2_000_000,
        val_fraction: float = 0.05,
        root: str | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"`val_fraction={val_fraction}` must be between 0 and 1 (exclusive).")
        self.block_size, self.batch_size = block_size, batch_size
        self.max_bytes, self.val_fraction, self.root = max_bytes, val_fraction, root

    @property
    def batch_shape(self) -> tuple[int, int]:
        """One training batch's shape, `(batch_size, block_size + 1)`: the `plan` dry run suggests it as
        `--batch-size` / `--seq-len` for its activation estimate."""
        return (self.batch_size, self.block_size + 1)

    def setup(self, stage: str) -> None:
        data = stdlib_source_bytes(self.max_bytes, self.root)
        split = int(len(data) * (1.0 - self.val_fraction))
        self.train_set = ByteWindows(data[:split], self.block_size + 1)
        self.val_set = ByteWindows(data[split:], self.block_size + 1)

    def train_dataloader(self) -> DataLoader:
        # Lightning adds the DistributedSampler over the data-parallel ranks (and it shuffles with its seed).
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, drop_last=True)
