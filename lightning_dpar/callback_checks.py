"""Lightning callbacks a strategy layout cannot run exactly, refused before the process group exists.

`ModelPruning` (torch.nn.utils.prune) re-registers each pruned parameter as `<name>_orig` with a `<name>_mask`
buffer and recomputes `<name>` in a forward pre-hook. FSDP2 and tensor parallelism own each parameter under its
name as a DTensor (FSDP2 swaps it between shard and whole tensor around every forward), and pipeline stages hold
only their own units; renaming parameters under them would train stale or partial weights, or fail mid-epoch on
shards (global L1 pruning cannot flatten a shard). With whole parameters on every rank (`ReplicateStrategy` without
tensor parallelism) it runs as under DDP.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.pytorch.callbacks import ModelPruning

__all__ = ["refuse_unsupported_callbacks"]


def refuse_unsupported_callbacks(callbacks: Sequence[Any], strategy: str, whole_parameters: bool) -> None:
    """Raise for a callback this layout cannot run: `whole_parameters` says whether every rank holds every
    parameter as a plain tensor (no sharding, tensor or pipeline parallelism)."""
    for callback in callbacks:
        if isinstance(callback, ModelPruning) and not whole_parameters:
            raise ValueError(
                f"{type(callback).__name__} cannot prune under {strategy}: torch.nn.utils.prune renames each pruned"
                " parameter (`weight` -> `weight_orig` plus a mask), but FSDP2, tensor and pipeline parallelism hold"
                " parameters by name as shards (DTensors) or per stage. Use strategy='dpar_replicate' (whole"
                " parameters on every rank, no tensor parallelism) to prune while training, or prune the trained"
                " model after consolidating it (`python -m lightning_dpar consolidate`)."
            )
