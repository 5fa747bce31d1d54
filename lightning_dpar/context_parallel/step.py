"""Context parallelism as one step of the parallelisation (`STEP`, in `lightning_dpar.parallel.parallelize.STEPS`
after expert parallelism and before activation checkpointing, which takes its checkpoint contexts): its slice of the
plan (`plan_context_parallel`), how it is applied (`apply_context_parallel`: the hooks installed, its result, which
later steps read back with `runtime_of` and `checkpoint_contexts`), and what it does around each step
(`around_step`). Everything else outside this folder knows of it is its mesh dim (`ParallelDims.context`) and its
option (`context_parallel_loss`)."""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, runtime_checkable

from torch import nn

import lightning_dpar.context_parallel.checks as checks
from lightning_dpar.context_parallel.loss import causal_lm_loss_module, check_loss_mode
from lightning_dpar.context_parallel.runtime import ContextParallel
from lightning_dpar.parallel_dims import ParallelDims, ParallelMeshes
from lightning_dpar.pipeline import step as pipeline_step
from lightning_dpar.pipeline.split import PipelineSplit
from lightning_dpar.steps.contract import Applying, Planning, Step, StepContext

__all__ = [
    "STEP",
    "ContextParallelPlan",
    "ModelFactsRead",
    "ModulePlanRead",
    "PlanOptionsRead",
    "apply_context_parallel",
    "around_step",
    "checkpoint_contexts",
    "plan_context_parallel",
    "runtime_of",
]


@runtime_checkable
class PlanOptionsRead(Protocol):
    """What the context-parallel step reads of the strategy's `PlanOptions`: its option and the strategy's name
    (refusals name the call)."""

    @property
    def context_parallel_loss(self) -> str: ...

    @property
    def strategy(self) -> str: ...


class _Recomputed(Protocol):
    @property
    def modules(self) -> list[str]: ...


@runtime_checkable
class ModelFactsRead(Protocol):
    """What it reads of the model's facts (`ModelFacts`): the modules activation checkpointing recomputes (none
    may cut a block)."""

    @property
    def checkpointing(self) -> _Recomputed: ...


@runtime_checkable
class ModulePlanRead(Protocol):
    """What it reads of the plan (`ModulePlan`) when it applies it: its slice, and the pipeline split with this
    rank's place in it (the hooks go on this rank's stages)."""

    @property
    def context_parallel(self) -> list[str]: ...

    @property
    def context_parallel_loss(self) -> str | None: ...

    @property
    def pipeline(self) -> PipelineSplit | None: ...

    @property
    def pipeline_rank(self) -> int: ...


@dataclass(frozen=True)
class ContextParallelPlan:
    """The blocks each sequence is split across, in order (every block of the model, also with pipeline
    parallelism: the hooks need its first and last), and with `context_parallel_loss="per_rank"` the causal LM whose
    loss each rank computes on its own tokens (`None`: the last block's output is gathered whole). Empty: no context
    parallelism."""

    blocks: list[str] = field(default_factory=list)
    loss_module: str | None = None


def plan_context_parallel(
    module: nn.Module,
    dims: ParallelDims,
    loss_mode: str,
    strategy: str,
    checkpointed: Sequence[str],
    stages: Sequence[Sequence[str]] | None,
) -> ContextParallelPlan:
    """The step's slice of the plan, with every refusal before the first collective: a model whose blocks or
    attention cannot be split, an activation-checkpointed module cutting a block, a pipeline split cutting one, and
    the per-rank loss across pipeline stages (`stages`: each stage's units; `None` without pipelining)."""
    if dims.context == 1:
        return ContextParallelPlan()
    per_rank = check_loss_mode(loss_mode) == "per_rank"
    if per_rank and stages is not None:
        raise ValueError(
            f"`{strategy}(pipeline_parallel_size={dims.pipeline}, context_parallel_size={dims.context},"
            " context_parallel_loss='per_rank')` is not supported yet: the per-rank loss is not implemented across"
            " pipeline stages. Use `context_parallel_loss='whole'` (the default, exact for any loss) with pipelining,"
            " or `pipeline_parallel_size=1`."
        )
    checks.check_model(module)
    blocks = [name for name, _ in checks.sequence_blocks(module)]
    checks.check_checkpointed_modules(blocks, checkpointed)
    if stages is not None:
        checks.check_pipeline_split(blocks, stages)
    return ContextParallelPlan(blocks, causal_lm_loss_module(module, blocks) if per_rank else None)


def apply_context_parallel(
    root: nn.Module,
    part: ContextParallelPlan,
    meshes: ParallelMeshes,
    stages: Sequence[Sequence[str]] | None = None,
) -> ContextParallel | None:
    """The hooks on `root`'s blocks that split each sequence over `meshes.context` (`stages`: this rank's pipeline
    stages' units; the other stages' blocks are remote units); `None` without context parallelism."""
    if not part.blocks:
        return None
    assert meshes.context is not None, "a context-parallel plan needs the context-parallel mesh"
    return ContextParallel.install(root, meshes.context.get_group(), part.blocks, part.loss_module, stages)


@contextmanager
def around_step(runtime: ContextParallel, training: bool, args: Sequence[Any]) -> Generator[None, None, None]:
    """Around each step's forward: a training batch checked first (no masked tokens, before the step's first
    collective), then each sequence split across the context-parallel ranks."""
    if training and args:
        checks.check_batch(args[0])
    with runtime.active():
        yield


def _plan(planning: Planning) -> Mapping[str, Any]:
    options: PlanOptionsRead = planning.options
    facts: ModelFactsRead = planning.facts
    split: PipelineSplit | None = planning.slices["pipeline"]
    part = plan_context_parallel(
        planning.module,
        planning.dims,
        options.context_parallel_loss,
        options.strategy,
        facts.checkpointing.modules,
        split.stages if split is not None else None,
    )
    return {"context_parallel": part.blocks, "context_parallel_loss": part.loss_module}


def _apply(root: nn.Module, plan: ModulePlanRead, applying: Applying) -> ContextParallel | None:
    stages = pipeline_step.rank_stages(plan.pipeline, plan.pipeline_rank)  # the other stages' blocks are remote
    part = ContextParallelPlan(plan.context_parallel, plan.context_parallel_loss)
    return apply_context_parallel(root, part, applying.meshes, stages)


def _around_step(runtime: ContextParallel | None) -> StepContext | None:
    return None if runtime is None else partial(around_step, runtime)


#: Context parallelism: after expert parallelism, before activation checkpointing (which takes its contexts).
STEP = Step("context parallel", _plan, _apply, _around_step)


def runtime_of(results: Mapping[str, Any]) -> ContextParallel | None:
    """The installed hooks, from the steps' results (`Applying.results`, `AppliedPlan.results`) once the step is
    applied; `None` without context parallelism."""
    return results.get(STEP.name)


def checkpoint_contexts(
    results: Mapping[str, Any],
) -> Callable[[], tuple[AbstractContextManager, AbstractContextManager]] | None:
    """The context managers a recomputed block's forward and recomputation run in, so that its attention is
    context-parallel again (`ContextParallel.checkpoint_contexts`); `None` without context parallelism."""
    runtime = runtime_of(results)
    return runtime.checkpoint_contexts if runtime is not None else None
