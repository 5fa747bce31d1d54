"""Planning's inputs and its model-wide pieces: `PlanOptions` (what a strategy's arguments say about the plan, frozen),
the checks of a model the user parallelised already (adopted as is), and the slices of the steps whose code is the
plan itself: tensor parallelism (`plan_tensor_parallel`, a `tp_plan` resolved against the model) and the
data-parallel wrapper's settings on a mesh (`data_parallel_settings`).

The walk that makes a `ModulePlan` is `lightning_dpar.parallel.parallelize.plan_modules`: it finds the model's facts
once, then asks each step of `STEPS` for its slice, in order. Everything here is pure (no process group): a plan that
does not fit fails the same way on every rank and in the `plan` dry run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_dpar.activation_checkpointing.step import ActivationCheckpointingSetting
from lightning_dpar.float8.config import Float8Options
from lightning_dpar.helpers import class_name, show_names
from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.pipeline.config import PipelineConfig
from lightning_dpar.plan.adapters import adapter_tp_plan
from lightning_dpar.plan.module_plan import DataParallelSettings
from lightning_dpar.plan.selectors import ModuleSelector, pattern_reaches, resolve_blocks
from lightning_dpar.plan.styles import AUTO, PlanStyle, parse_tp_plan
from lightning_dpar.plan.tensor_parallel import TensorParallelSizeError, resolve_tp_plan, tensor_parallel_size_fix
from lightning_dpar.plan.transformers import transformers_experts, transformers_tp_plan

__all__ = [
    "PlanOptions",
    "check_adoptable",
    "data_parallel_settings",
    "expert_selectors",
    "plan_tensor_parallel",
    "shard_units",
]


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
            contract, `lightning_dpar.experts.plan`).
        context_parallel_loss: `"whole"` or `"per_rank"` (`lightning_dpar.context_parallel.loss`).
        loss_parallel: keep the output layer's logits sharded over the vocabulary under tensor parallelism and
            compute the cross-entropy vocabulary-parallel (`lightning_dpar.loss_parallel`); the output layer's
            vocabulary then need not divide by the tensor-parallel size.
        float8: the float8 setting, resolved (`lightning_dpar.float8.config.Float8Options`: torchao's config and
            the modules kept in high precision), or `None`.
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
    loss_parallel: bool = False
    float8: Float8Options | None = None
    data_parallel: DataParallelSettings = field(default_factory=DataParallelSettings)


def data_parallel_settings(dims: ParallelDims, options: PlanOptions) -> DataParallelSettings:
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


def expert_selectors(module: nn.Module, options: PlanOptions) -> Sequence[ModuleSelector] | None:
    """The experts modules' source, first found: the strategy's `expert_modules`, the `base_model_ep_plan` of the
    transformers model the module holds; `None`: found by the experts contract."""
    if options.expert_modules is not None:
        return options.expert_modules
    return transformers_experts(module)


def shard_units(module: nn.Module, options: PlanOptions, blocks: list[str]) -> list[str]:
    """FSDP units below the top-level children; none for a wrapper that does not shard."""
    return resolve_blocks(module, options.shard_modules, "shard_modules", blocks) if options.shards else []


def check_adoptable(module: nn.Module, dims: ParallelDims, options: PlanOptions) -> None:
    """A model the user parallelised in `configure_model` is only accepted by strategies that adopt it (`dpar_2d`,
    with no `tp_plan`, no pipeline and no expert parallelism of its own, so nothing is applied twice)."""
    if dims.pipeline > 1:
        raise TypeError(
            f"{class_name(module)} was already parallelised (in `configure_model` or before `fit`); with"
            " `pipeline_parallel_size > 1` the strategy splits the model into stages first and parallelises each"
            " stage itself. Remove the manual `fully_shard` / `parallelize_module` calls and give a `tp_plan`."
        )
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


def plan_tensor_parallel(
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
        # Under loss parallel the output layer (its column-wise output gathered) may split an uneven vocabulary:
        # DTensor shards it unevenly and torch's `loss_parallel()` is exact on uneven shards.
        return resolve_tp_plan(module, adapted, dims.tensor_parallel, uneven_gathered_columns=options.loss_parallel)
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
