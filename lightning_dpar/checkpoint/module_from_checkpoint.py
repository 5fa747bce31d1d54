"""`lightning_dpar.load_from_checkpoint(cls, path)`: a LightningModule from a sharded checkpoint, in one process.

Lightning's `LightningModule.load_from_checkpoint` reads one file; on a sharded directory it raises
`IsADirectoryError`. This helper assembles the weights (and hyperparameters) from the shards, then hands them to
Lightning's own `load_from_checkpoint`, so hyperparameter restoration, `on_load_checkpoint` and `strict` behave
exactly as for a single-file checkpoint. A full-format file is vetted by the same reader as `fit(ckpt_path=...)`,
then passed through unchanged. Nothing is ever unpickled with `weights_only=False`.
"""

from __future__ import annotations

import io
import os
from typing import Any, TypeVar

import lightning as L
import torch

from lightning_dpar.checkpoint.adapter_only import refuse_without_base
from lightning_dpar.checkpoint.contents import DPAR_KEY, describe_problem
from lightning_dpar.checkpoint.errors import CheckpointLoadError
from lightning_dpar.checkpoint.full import read_full
from lightning_dpar.checkpoint.offline_reader import OfflineCheckpoint
from lightning_dpar.checkpoint.storage import Location

__all__ = [
    "load_from_checkpoint",
]

ModuleT = TypeVar("ModuleT", bound=L.LightningModule)


def load_from_checkpoint(
    cls: type[ModuleT], path: str | os.PathLike[str], strict: bool | None = None, **kwargs: Any
) -> ModuleT:
    """Build `cls` from the checkpoint at `path` (sharded directory or full file) for inference on one process.

    `strict` and `**kwargs` (hyperparameter overrides, `map_location`) are passed to
    `LightningModule.load_from_checkpoint`. Optimizer state is not read.
    """
    location = Location.parse(path)
    problem = describe_problem(location)
    if problem is not None:
        raise CheckpointLoadError(problem)
    if not location.is_dir():
        # Vetted by our reader first (memory-mapped locally, so cheap): content that would run code, a truncated or
        # foreign file, or a newer format fail with a message naming the file instead of torch's raw error.
        refuse_without_base(read_full(location).get(DPAR_KEY, {}), location.url, "`load_from_checkpoint`")
        return cls.load_from_checkpoint(str(path), strict=strict, weights_only=True, **kwargs)
    offline = OfflineCheckpoint(str(path))
    refuse_without_base(offline.info.dpar_record, location.url, "`load_from_checkpoint`")
    checkpoint = offline.lightning_checkpoint(with_optimizers=False)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    del checkpoint
    buffer.seek(0)
    return cls.load_from_checkpoint(buffer, strict=strict, weights_only=True, **kwargs)
