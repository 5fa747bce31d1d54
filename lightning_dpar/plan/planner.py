"""Planning: one function of the model, the mesh sizes and the strategy's frozen options, shared by training and
the `plan` dry run, that returns the `ModulePlan`.

The model passes through once, in this order: refuse what cannot compose (classic DDP / FSDP1 wrappers), note
whether it was parallelised already (adopted as is), find its repeated blocks and tied parameters, split it into
pipeline stages, resolve the tensor-parallel plan, choose the FSDP units, activation-checkpointed and compiled
modules, and what the data-parallel wrapper needs (its top-level units, the modules it leaves unsynchronised, whether
an adopted model is sharded already). Each fact is found once here and carried in the plan; `parallelize.apply_plan`
and the strategies' wrappers only apply it. Pure (no process group): a plan that does not fit fails the same way on
every rank before any collective, and in the dry run.

The plan's slices are made in the order the steps apply (`lightning_dpar.parallel.parallelize.STEPS`): the
pipeline split, tensor and expert parallelism, context parallelism (its own slice, from
`lightning_dpar.context_parallel.step`), activation checkpointing, compile, the data-parallel wrapper's settings. A
model with or without pipeline parallelism goes through the same calls; with it, the plan is then restricted to this
rank's stages (`local_plan`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_dpar.activation_checkpointing.step import ActivationCheckpointingSetting, plan_activation_checkpointing
from lightning_dpar.conformance.batchnorm import check_no_batch_norm_in_pipeline
from lightning_dpar.context_parallel.step import plan_context_parallel
from lightning_dpar.helpers import class_name, show_names
from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.pipeline.config import PipelineConfig
from lightning_dpar.pipeline.split import PipelineSplit, resolve_split
from lightning_dpar.plan.adapters import adapter_tp_plan
from lightning_dpar.plan.compile import compile_units
from lightning_dpar.plan.experts import pattern_reaches, plan_experts
from lightning_dpar.plan.initialisers import check_initialisable
from lightning_dpar.plan.module_plan import DataParallelSettings, ModulePlan, local_plan
from lightning_dpar.plan.selectors import (
    ModuleSelector,
    resolve_activation_checkpointing,
    resolve_blocks,
    select_modules,
)
from lightning_dpar.plan.structure import (
    check_not_wrapped_by_other_parallelism,
    data_parallel_roots,
    has_fully_shard,
    is_parallelized,
    repeated_blocks,
)
from lightning_dpar.plan.styles import AUTO, PlanStyle, parse_tp_plan
from lightning_dpar.plan.tensor_parallel import TensorParallelSizeError, resolve_tp_plan, tensor_parallel_size_fix
from lightning_dpar.plan.ties import check_each_in_one_unit, check_tied_layouts, tied_parameters
from lightning_dpar.plan.transformers import transformers_experts, transformers_tp_plan

__all__ = ["PlanOptions", "plan_modules"]


@dataclass(frozen=True)
class PlanOptions:
    """What a strategy's arguments say about the plan; built by the strategy (`DparStrategy.plan_options`).

    Args:
        strategy: the strategy's class name, for error messages.
        tp_plan: the strategy's `tp_plan` argument, parsed, or `"auto"`, or `None` (then the LightningModule's
            `tp_plan` attribute, then a transformers model's own plan).
        activation_checkpointing: `True` (full), `"selective"` (the op-level policy,
            `lightning_dpar.activation_checkpointing`), or class names / module-name globs.
        compile: `torch.compile` options, or `None` (eager).
        pipeline: the pipeline settings (used when the mesh has a pipeline dim).
        kept_size_args: the strategy arguments an error's suggested fix keeps (`pipeline_parallel_size=2`).
        shards: whether the data-parallel wrapper shards (FSDP): then FSDP units are planned.
        shard_modules: the FSDP units' selectors (`None`: the repeated blocks).
        adopts_parallelized: whether a model parallelised in `configure_model` is adopted (`dpar_2d`) or refused.
        ddp_units: whether the wrapper is DDP when there is no tensor parallelism (`dpar_replicate`): then tied
            parameters must sit inside one of its units.
        ignored_modules: selectors of the modules whose gradients are not synchronised (`dpar_replicate`).
        expert_modules: selectors of the experts modules split by expert parallelism (`None`: found by the experts
            contract, `lightning_dpar.plan.experts`).
        context_parallel_loss: `"whole"` or `"per_rank"` (`lightning_dpar.context_parallel.loss`).
        data_parallel: how the data-parallel step wraps the model (`ModulePlan.data_parallel`); the planner adapts
            it to the mesh (FSDP replicas for `replicate` with tensor parallelism; no resharding after forward under
            a pipeline schedule that defers weight gradients).
    """

    strategy: str
    tp_plan: Mapping[str, PlanStyle] | str | None = None
    activation_checkpointing: ActivationCheckpointingSetting = False
    compile: Mapping[str, Any] | None = None
    pipeline: PipelineConfig | None = None
    kept_size_args: tuple[tuple[str, object], ...] = ()
    shards: bool = False
    shard_modules: Sequence[ModuleSelector] | None = None
    adopts_parallelized: bool = False
    ddp_units: bool = False
    ignored_modules: Sequence[ModuleSelector] = ()
    expert_modules: Sequence[ModuleSelector] | None = None
    context_parallel_loss: str = "whole"
    data_parallel: DataParallelSettings = field(default_factory=DataParallelSettings)


def plan_modules(module: nn.Module, dims: ParallelDims, options: PlanOptions, rank: int = 0) -> ModulePlan:
    """What will be applied to which submodule of `module` on a world of `dims`, as seen by global rank `rank` (it
    matters only with pipeline parallelism, where each rank holds other stages).

    Pure (no process group): a plan that does not fit the model (a pattern matching nothing, a tensor-parallel size
    that does not divide a sharded dimension or head count, a split leaving a stage empty) fails the same way on
    every rank and in the `plan` dry run.
    """
    check_not_wrapped_by_other_parallelism(module, options.strategy)
    parallelized = is_parallelized(module)
    blocks = repeated_blocks(module)
    if parallelized:
        return _adopted_plan(module, dims, options, blocks)
    shard_units = _shard_units(module, options, blocks)
    split = _pipeline_split(module, dims, options, shard_units, blocks)
    tied = tied_parameters(module)
    experts = plan_experts(module, dims.expert, dims.shard, _expert_selectors(module, options))
    tensor_parallel = _tensor_parallel(module, dims, options, experts)
    check_tied_layouts(module, tied, tensor_parallel)
    roots = [] if split is not None else data_parallel_roots(module)  # refuses containers holding parameters
    if split is None and options.ddp_units and dims.tensor_parallel == 1:  # with TP the replicas are FSDP units
        check_each_in_one_unit(tied, roots, options.strategy)
    ignored = select_modules(module, options.ignored_modules, "ignored_modules") if options.ignored_modules else []
    check_initialisable(module)
    checkpointing = plan_activation_checkpointing(
        module,
        options.activation_checkpointing,
        lambda spec: resolve_activation_checkpointing(module, spec, shard_units, blocks),
        options.strategy,
    )
    checkpointed = checkpointing.modules
    context = plan_context_parallel(
        module,
        dims,
        options.context_parallel_loss,
        options.strategy,
        checkpointed,
        split.stages if split is not None else None,
    )
    whole = ModulePlan(
        tensor_parallel=tensor_parallel,
        activation_checkpointing=checkpointed,
        activation_checkpointing_policy=checkpointing.policy,
        shard_units=shard_units,
        compile_units=compile_units(module, shard_units, blocks, roots or None),
        tied=tied,
        experts=list(experts),
        data_parallel_roots=roots,
        ignored=list(ignored),
        context_parallel=context.blocks,
        context_parallel_loss=context.loss_module,
        data_parallel=_data_parallel(dims, options),
    )
    if split is None:
        return whole
    return local_plan(whole, split, pipeline_rank=rank // (dims.world_size // dims.pipeline))


def _adopted_plan(module: nn.Module, dims: ParallelDims, options: PlanOptions, blocks: list[str]) -> ModulePlan:
    """The plan of a model the user parallelised in `configure_model`: no tensor or expert parallelism added, FSDP
    units only if it applied none itself."""
    if dims.pipeline > 1:
        raise TypeError(
            f"{class_name(module)} was already parallelised (in `configure_model` or before `fit`); with"
            " `pipeline_parallel_size > 1` the strategy splits the model into stages first and parallelises each"
            " stage itself. Remove the manual `fully_shard` / `parallelize_module` calls and give a `tp_plan`."
        )
    _check_adoptable(module, dims, options)
    shard_units = _shard_units(module, options, blocks)
    sharded = has_fully_shard(module)  # the wrapper adds no units of its own, so needs no top-level units
    roots = [] if sharded else data_parallel_roots(module)
    context = plan_context_parallel(module, dims, options.context_parallel_loss, options.strategy, [], None)
    return ModulePlan(
        {},
        [],
        shard_units,
        compile_units(module, shard_units, blocks, roots or None),
        adopted=True,
        adopted_sharded=sharded,
        data_parallel_roots=roots,
        context_parallel=context.blocks,
        context_parallel_loss=context.loss_module,
        data_parallel=_data_parallel(dims, options),
    )


def _pipeline_split(
    module: nn.Module, dims: ParallelDims, options: PlanOptions, shard_units: list[str], blocks: list[str]
) -> PipelineSplit | None:
    """The split into pipeline stages (the pipeline step's slice of the plan); `None` without pipelining."""
    if dims.pipeline == 1:
        return None
    config = options.pipeline
    assert config is not None, "a strategy that pipelines gives its pipeline settings"
    config.check(dims.pipeline)
    check_no_batch_norm_in_pipeline(module, dims.pipeline)
    return resolve_split(
        module,
        shard_units or blocks,
        config.split,
        dims.pipeline,
        config.stages_per_rank,
        config.schedule.placement,
        config.call_order,
    )


def _data_parallel(dims: ParallelDims, options: PlanOptions) -> DataParallelSettings:
    """The data-parallel step's settings on this mesh: DDP's reducer cannot hold tensor-parallel parameters, so
    `replicate` with tensor parallelism replicates with FSDP2 over a shard group of size 1; a pipeline schedule
    that computes weight gradients later needs the unsharded parameters until then."""
    settings = options.data_parallel
    if settings.wrapper == "replicate" and dims.tensor_parallel > 1:
        settings = replace(settings, wrapper="fully_shard_replicas")
    pipeline = options.pipeline
    if dims.pipeline > 1 and pipeline is not None and pipeline.schedule.defers_weight_gradients:
        settings = replace(settings, reshard_after_forward=False)
    return settings


def _expert_selectors(module: nn.Module, options: PlanOptions) -> Sequence[ModuleSelector] | None:
    """The experts modules' source, first found: the strategy's `expert_modules`, the `base_model_ep_plan` of the
    transformers model the module holds; `None`: found by the experts contract."""
    if options.expert_modules is not None:
        return options.expert_modules
    return transformers_experts(module)


def _shard_units(module: nn.Module, options: PlanOptions, blocks: list[str]) -> list[str]:
    """FSDP units below the top-level children; none for a wrapper that does not shard."""
    return resolve_blocks(module, options.shard_modules, "shard_modules", blocks) if options.shards else []


def _check_adoptable(module: nn.Module, dims: ParallelDims, options: PlanOptions) -> None:
    """A model the user parallelised in `configure_model` is only accepted by strategies that adopt it (`dpar_2d`,
    with no `tp_plan` and no expert parallelism of its own, so nothing is applied twice)."""
    if dims.expert > 1:
        raise TypeError(
            f"{class_name(module)} was already parallelised (in `configure_model` or before `fit`), and the strategy"
            f" was given `expert_parallel_size={dims.expert}`, which splits the experts of a model it parallelises"
            " itself. Remove the manual `fully_shard` / `parallelize_module` calls, or set `expert_parallel_size=1`."
        )
    if not options.adopts_parallelized:
        raise TypeError(
            f"{class_name(module)} was already parallelised (in `configure_model` or before `fit`);"
            f" {options.strategy} applies its own parallelism. Remove the manual `fully_shard` /"
            " `parallelize_module` / `replicate` calls, or use strategy='dpar_2d', which adopts them."
        )
    if options.tp_plan is not None:
        raise ValueError(
            f"{class_name(module)}.configure_model already parallelised the model, and the strategy was"
            " also given a `tp_plan`. Use one or the other, so the plan is not applied twice."
        )


def _tensor_parallel(
    module: nn.Module, dims: ParallelDims, options: PlanOptions, experts: Sequence[str]
) -> dict[str, ParallelStyle]:
    """The resolved tensor-parallel plan. Expert parallelism owns the experts modules: a transformers model's own
    plan leaves them out (its `base_model_ep_plan` takes precedence there), and a plan of the user's that reaches
    into one is refused, since its experts are split over the expert ranks already."""
    tp_plan = _tp_plan_source(module, dims, options, experts)
    return _resolve_tp_plan(module, tp_plan, dims, options, experts) if tp_plan else {}


def _resolve_tp_plan(
    module: nn.Module,
    tp_plan: Mapping[str, PlanStyle],
    dims: ParallelDims,
    options: PlanOptions,
    experts: Sequence[str] = (),
) -> dict[str, ParallelStyle]:
    """`resolve_tp_plan`; a size that does not divide the model says how to set one that does, for this strategy."""
    adapted = adapter_tp_plan(module, tp_plan)
    inside = [pattern for pattern in adapted if pattern_reaches(pattern, experts)]
    if inside:
        raise ValueError(
            f"The `tp_plan` gives tensor-parallel styles to {show_names(inside)}, inside the experts modules that"
            f" `expert_parallel_size={dims.expert}` splits between expert ranks. Leave the experts out of the"
            " `tp_plan` (expert parallelism already splits them), or set `expert_parallel_size=1`."
        )
    try:
        return resolve_tp_plan(module, adapted, dims.tensor_parallel)
    except TensorParallelSizeError as error:
        per_size = dims.pipeline * dims.replicate  # ranks per tensor-parallel rank outside the shard dim

        def tiles(size: int) -> bool:
            return dims.world_size % (size * per_size) == 0

        kept = dict(options.kept_size_args)
        fix = tensor_parallel_size_fix(options.strategy, error.valid_sizes, tiles, kept)
        raise TensorParallelSizeError(f"{error}{fix}", error.valid_sizes) from None


def _tp_plan_source(
    module: nn.Module, dims: ParallelDims, options: PlanOptions, experts: Sequence[str]
) -> dict[str, PlanStyle] | None:
    """The plan's source, first found: the strategy's `tp_plan` argument, the LightningModule's `tp_plan`
    attribute, the plan of the transformers model it holds (also what `tp_plan="auto"` asks for; without the
    `experts` modules, which expert parallelism splits)."""
    if dims.tensor_parallel == 1:
        return None
    attribute = getattr(module, "tp_plan", None)
    for source in (options.tp_plan, attribute):
        if source is not None and source != AUTO:
            return parse_tp_plan(source)
    plan = parse_tp_plan(transformers_tp_plan(module, leave_out=experts))
    if plan is not None:
        return plan
    name = class_name(module)
    if AUTO in (options.tp_plan, attribute):
        found = f"`tp_plan='auto'` found no transformers model with a tensor-parallel plan in {name}"
    else:
        found = f"none was given (strategy argument, `tp_plan` attribute on {name}, or a transformers model's plan)"
    raise ValueError(
        f"`tensor_parallel_size={dims.tensor_parallel}` needs a `tp_plan`, but {found}. Give a `tp_plan`"
        " ({module-name pattern: style}), or write a `configure_model` that parallelises the model with"
        " `self.device_mesh`."
    )
