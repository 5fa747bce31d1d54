"""Which modules `compile` compiles (each in place, see `lightning_dpar.parallel.compilation`)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_dpar.plan.structure import data_parallel_roots, repeated_blocks

__all__ = ["compile_units"]


def compile_units(
    root: nn.Module,
    shard_units: Sequence[str],
    blocks: Sequence[str] | None = None,
    top_level_units: Sequence[str] | None = None,
) -> list[str]:
    """Modules compiled one by one: the FSDP units (each block's graph then sits between its own all-gather and
    reduce-scatter, so communication overlaps compute); without units, the repeated blocks; without those, the
    top-level children of the LightningModule.

    The LightningModule itself is never compiled: Lightning calls `training_step`, not `forward`. `blocks` and
    `top_level_units`: the repeated blocks and the data-parallel roots, when the planner found them already.
    """
    if shard_units:
        return list(shard_units)
    blocks = list(blocks) if blocks is not None else repeated_blocks(root)
    return blocks or list(top_level_units if top_level_units is not None else data_parallel_roots(root))
