"""Pipeline parallelism as one step of the parallelisation (the first of `lightning_dpar.parallel.parallelize.STEPS`):
its slice of the plan (`plan_pipeline_split`: the model's units split into stages) and how it is applied
(`apply_pipeline_split`: this rank's stages kept, every other stage's units replaced by parameterless stand-ins).
Outside this folder the feature is its mesh dim (`ParallelDims.pipeline`), its options (`PipelineConfig`) and the
stages later steps read."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.pipeline.config import PipelineConfig
from lightning_dpar.pipeline.split import PipelineSplit, resolve_split
from lightning_dpar.pipeline.stage import PipelinedModel, split_into_stages

__all__ = ["apply_pipeline_split", "plan_pipeline_split", "rank_stages"]


def plan_pipeline_split(
    module: nn.Module, dims: ParallelDims, config: PipelineConfig | None, units: Sequence[str]
) -> PipelineSplit | None:
    """The split of `module`'s `units` (its FSDP units, else its repeated blocks) into stages; `None` without
    pipelining. Refuses a schedule the pipeline size cannot run and a split leaving a stage empty, before any
    collective."""
    if dims.pipeline == 1:
        return None
    assert config is not None, "a strategy that pipelines gives its pipeline settings"
    config.check(dims.pipeline)
    return resolve_split(
        module,
        units,
        config.split,
        dims.pipeline,
        config.stages_per_rank,
        config.schedule.placement,
        config.call_order,
    )


def rank_stages(split: PipelineSplit | None, pipeline_rank: int) -> list[Sequence[str]] | None:
    """The units of each of `pipeline_rank`'s stages, in execution order; `None` without pipelining."""
    if split is None:
        return None
    return [split.stages[stage] for stage in split.stages_of_rank(pipeline_rank)]


def apply_pipeline_split(
    root: nn.Module, split: PipelineSplit | None, pipeline_rank: int, device: torch.device
) -> PipelinedModel | None:
    """This rank's stages of `root`, on `device` (the meta device in the dry run); the other stages' units are
    dropped first, so no rank ever allocates them. `None` without pipelining."""
    return None if split is None else split_into_stages(root, split, pipeline_rank, device)
