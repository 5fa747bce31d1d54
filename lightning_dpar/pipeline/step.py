"""Pipeline parallelism as one step of the parallelisation (`STEP`, the first of
`lightning_dpar.parallel.parallelize.STEPS`): its slice of the plan (`plan_pipeline_split`: the model's units split
into stages, after the BatchNorm refusal) and how it is applied (`apply_pipeline_split`: this rank's stages kept,
every other stage's units replaced by parameterless stand-ins; its result, this rank's `PipelinedModel`, is what
`pipelined` reads back for later steps), and its runner (`pipeline_runner`: the schedule takes Lightning's step hooks
over). Outside this folder the feature is its mesh dim (`ParallelDims.pipeline`), its options (`PipelineConfig`) and
the stages later steps read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from lightning_dpar.conformance.batchnorm import check_no_batch_norm_in_pipeline
from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.pipeline.config import PipelineConfig
from lightning_dpar.pipeline.runner import CheckpointsRead, PipelineSteps, PrecisionRead
from lightning_dpar.pipeline.runtime import PipelineRuntime
from lightning_dpar.pipeline.split import PipelineSplit, resolve_split
from lightning_dpar.pipeline.stage import PipelinedModel, split_into_stages
from lightning_dpar.steps.contract import Applying, Planning, Running, Step

__all__ = [
    "STEP",
    "ModelFactsRead",
    "ModulePlanRead",
    "PlanOptionsRead",
    "apply_pipeline_split",
    "pipeline_runner",
    "pipelined",
    "plan_pipeline_split",
    "rank_stages",
]


@runtime_checkable
class PlanOptionsRead(Protocol):
    """What the pipeline split step reads of the strategy's `PlanOptions` (its runner too: the schedule and
    microbatches)."""

    @property
    def pipeline(self) -> PipelineConfig | None: ...


@runtime_checkable
class ModelFactsRead(Protocol):
    """What it reads of the model's facts (`ModelFacts`): the units it splits, the FSDP units, else the repeated
    blocks."""

    @property
    def shard_units(self) -> list[str]: ...

    @property
    def blocks(self) -> list[str]: ...


@runtime_checkable
class ModulePlanRead(Protocol):
    """What it reads of the plan (`ModulePlan`) when it applies it: the split and this rank's place in it."""

    @property
    def pipeline(self) -> PipelineSplit | None: ...

    @property
    def pipeline_rank(self) -> int: ...


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


def _plan(planning: Planning) -> Mapping[str, Any]:
    """The split (`ModulePlan.pipeline`), after refusing BatchNorm layers, which would normalise each microbatch."""
    module, dims = planning.module, planning.dims
    options: PlanOptionsRead = planning.options
    facts: ModelFactsRead = planning.facts
    if dims.pipeline > 1:
        check_no_batch_norm_in_pipeline(module, dims.pipeline)
    return {"pipeline": plan_pipeline_split(module, dims, options.pipeline, facts.shard_units or facts.blocks)}


def _apply(root: nn.Module, plan: ModulePlanRead, applying: Applying) -> PipelinedModel | None:
    device = applying.meshes.device if applying.materialize else torch.device("meta")
    return apply_pipeline_split(root, plan.pipeline, plan.pipeline_rank, device)


def pipeline_runner(pipelined: PipelinedModel | None, running: Running) -> PipelineSteps | None:
    """The runner of a pipelined run (`None` without pipelining): the schedule over this rank's stages; gradient
    norms summed over every stage; the checkpoint manager told which units other stages hold."""
    if pipelined is None:
        return None
    options: PlanOptionsRead = running.options
    precision: PrecisionRead = running.precision
    checkpoints: CheckpointsRead = running.checkpoints
    assert options.pipeline is not None, "a strategy that pipelines gives its pipeline settings"
    group = running.meshes.pipeline_group
    runtime = PipelineRuntime(pipelined, running.module, options.pipeline, group, running.device)
    precision.reduce_norms_across(group, running.device)  # the norm spans every stage
    checkpoints.hold_pipeline_stages(pipelined.remote_units, group)
    return PipelineSteps(runtime, precision)


#: The pipeline split: the first step, so that every later step sees only this rank's stages; its runner, the
#: schedule, takes the training step over.
STEP = Step("pipeline split", _plan, _apply, runner=pipeline_runner)


def pipelined(results: Mapping[str, Any]) -> PipelinedModel | None:
    """This rank's stages, from the steps' results (`Applying.results`, `AppliedPlan.results`) once the split is
    applied; `None` without pipelining."""
    return results.get(STEP.name)
