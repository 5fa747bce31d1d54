"""Lightning callbacks a strategy layout cannot run exactly, refused before the process group exists, and the error
every pipeline rank raises when some stage cannot build its optimizer.

`BaseFinetuning` (`BackboneFinetuning`) under tensor parallelism: `filter_on_optimizer` compares each parameter it
unfreezes with every optimizer parameter by value (`torch.equal`), which DTensors on different meshes (the
tensor-parallel parameters and the data-parallel-only ones of a 2D layout) cannot do.

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

from lightning.pytorch.callbacks import BaseFinetuning, ModelPruning
from torch import nn

__all__ = ["optimizer_problem", "refuse_unsupported_callbacks"]


def refuse_unsupported_callbacks(
    callbacks: Sequence[Any], strategy: str, whole_parameters: bool, tensor_parallel: int
) -> None:
    """Raise for a callback this layout cannot run: `whole_parameters` says whether every rank holds every
    parameter as a plain tensor (no sharding, tensor or pipeline parallelism)."""
    for callback in callbacks:
        if isinstance(callback, BaseFinetuning) and tensor_parallel > 1 and _compares_by_value(callback):
            raise ValueError(
                f"{type(callback).__name__} cannot unfreeze parameters under {strategy} with"
                f" `tensor_parallel_size={tensor_parallel}`: Lightning's `BaseFinetuning.filter_on_optimizer`"
                " compares each parameter it adds with every parameter of the optimizer by value (`torch.equal`),"
                " which fails between tensor-parallel parameters and the others (DTensors on different meshes). Use"
                " strategy='dpar_fsdp' or 'dpar_hsdp' (no tensor parallelism), or subclass the callback and override"
                " `filter_on_optimizer` to compare parameters by identity (`p is param`)."
            )
        if isinstance(callback, ModelPruning) and not whole_parameters:
            raise ValueError(
                f"{type(callback).__name__} cannot prune under {strategy}: torch.nn.utils.prune renames each pruned"
                " parameter (`weight` -> `weight_orig` plus a mask), but FSDP2, tensor and pipeline parallelism hold"
                " parameters by name as shards (DTensors) or per stage. Use strategy='dpar_replicate' (whole"
                " parameters on every rank, no tensor parallelism) to prune while training, or prune the trained"
                " model after consolidating it (`python -m lightning_dpar consolidate`)."
            )


def _compares_by_value(callback: BaseFinetuning) -> bool:
    """Whether the callback keeps Lightning's `filter_on_optimizer` (a subclass may compare by identity)."""
    return type(callback).filter_on_optimizer is BaseFinetuning.filter_on_optimizer


def optimizer_problem(error: Exception, stage: nn.Module | None, callbacks: Sequence[Any], rank: int) -> str:
    """What to say on every rank when `configure_optimizers` raised `error` on this pipeline rank: a stage whose
    parameters are all frozen (a finetuning callback froze the backbone) gets an empty parameter list when the
    optimizer takes the trainable parameters only, as Lightning's finetuning docs recommend."""
    problem = f"`configure_optimizers` failed on pipeline rank {rank}: {type(error).__name__}: {error}."
    finetuning = [type(c).__name__ for c in callbacks if isinstance(c, BaseFinetuning)]
    if stage is not None and not any(p.requires_grad for p in stage.parameters()):
        frozen_by = f" ({', '.join(finetuning)} froze them before training)" if finetuning else ""
        problem += (
            f" Every parameter this rank's pipeline stage holds is frozen{frozen_by}, so an optimizer over the"
            " trainable parameters has none. Split the pipeline so that every stage holds parameters trained from"
            " the start (`pipeline_split`), or build the optimizer over all parameters (frozen ones get no"
            " gradient and are skipped), or train without pipeline parallelism."
        )
    return problem
