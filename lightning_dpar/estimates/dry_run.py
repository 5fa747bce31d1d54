"""The dry run's engine: `plan(strategy, module, world_size)` runs the training code path on a meta-device model
inside a fake process group of `world_size` ranks, and fills in a `PlanReport` (`lightning_dpar.estimates.report`).

The strategy's `resolve_dims`, `ParallelDims.build_meshes`, and the strategy's `module_plan` and `apply_plan`
(tensor parallel, activation checkpointing, compile, FSDP or replicate) run as in training,
without materialisation; the strategy object is only read, never changed. With pipeline parallelism each pipeline
rank is planned the same way on its own meta copy of the model (`_pipeline_report`). Given a batch shape, the
activations are estimated on a copy of the model taken before any parallelism, under the plans of every pipeline
rank (`lightning_dpar.estimates.activations.estimate_activations`).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.optim import Optimizer

import lightning_dpar.estimates.state_memory as state_memory
from lightning_dpar._private_api import attach_device_mesh, is_composable_replicated
from lightning_dpar.estimates.activations import ActivationEstimate, TraceCache, estimate_activations
from lightning_dpar.estimates.report import ROOT, ParamRow, PipelineReport, PlanReport, StageRow
from lightning_dpar.experts.estimate import describe_experts
from lightning_dpar.optim.exactness import exactness_summary
from lightning_dpar.parallel import parallelize
from lightning_dpar.parallel_dims import ParallelDims, ParallelMeshes, init_fake_process_group
from lightning_dpar.pipeline.estimate import (
    peer_rank,
    pipeline_rank_of,
    stage_ranks,
    unsharded_units_note,
)
from lightning_dpar.plan import ModulePlan
from lightning_dpar.plan.ties import describe_tp_placement
from lightning_dpar.strategies.base import DparStrategy

__all__ = ["describe_style", "plan", "strategy_activations"]


def _placement(param: torch.Tensor) -> str:
    if not isinstance(param, DTensor):
        return "whole on every rank"
    names = param.device_mesh.mesh_dim_names or tuple(str(i) for i in range(param.device_mesh.ndim))
    return ", ".join(f"{name}:{p}" for name, p in zip(names, param.placements))


def describe_style(style: ParallelStyle) -> str:
    """`ColwiseParallel(output=Replicate)`: the style and the layouts where they differ from its defaults."""
    defaults = type(style)()
    changed = [
        f"{label}={_layouts(getattr(style, attribute))}"
        for attribute, label in (("input_layouts", "input"), ("output_layouts", "output"), ("sequence_sharding", "seq"))
        if getattr(style, attribute, None) != getattr(defaults, attribute, None)
    ]
    return f"{type(style).__name__}({', '.join(changed)})" if changed else type(style).__name__


def _layouts(value: Any) -> str:
    values = value if isinstance(value, tuple) else (value,)
    return ",".join(repr(v) for v in values)


def _describe_modules(module: nn.Module, plan: ModulePlan, compiling: bool, dims: ParallelDims) -> dict[str, list[str]]:
    described: dict[str, list[str]] = {}
    for fqn, style in plan.tensor_parallel.items():
        described.setdefault(fqn, []).append(f"TP {describe_style(style)}")
    for fqn in plan.experts:
        described.setdefault(fqn, []).append(f"expert parallel {dims.expert}")
    for fqn in plan.activation_checkpointing:
        described.setdefault(fqn, []).append("activation checkpointing")
    for fqn in plan.compile_units if compiling else []:
        described.setdefault(fqn, []).append("compile")
    for fqn, sub in module.named_modules():
        if not fqn:
            if isinstance(sub, FSDPModule):  # parameters registered on the LightningModule itself
                described[ROOT] = ["FSDP unit (its own parameters; step methods gather them)"]
            continue
        if isinstance(sub, FSDPModule):
            described.setdefault(fqn, []).append("FSDP unit")
        if is_composable_replicated(sub):
            described.setdefault(fqn, []).append("replicate (DDP)")
    order = {fqn or ROOT: i for i, (fqn, _) in enumerate(module.named_modules())}
    return dict(sorted(described.items(), key=lambda item: order[item[0]]))


def _optimizers(configured: Any) -> list[Optimizer]:
    """Optimizers from any of the return shapes `configure_optimizers` may use."""
    if isinstance(configured, Optimizer):
        return [configured]
    if isinstance(configured, dict):
        return _optimizers(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)):
        if len(configured) == 2 and all(isinstance(x, (list, tuple)) for x in configured):
            return _optimizers(configured[0])
        return [opt for item in configured for opt in _optimizers(item)]
    return []


def plan(
    strategy: DparStrategy,
    module: L.LightningModule,
    world_size: int,
    num_nodes: int = 1,
    rank: int = 0,
    batch: Any = None,
    batch_source: str = "",
    traces: TraceCache | None = None,
) -> PlanReport:
    """Apply `strategy` to `module` (built on the meta device) as rank `rank` of `world_size` would, and report.

    `batch` is what one data-parallel rank's `training_step` receives per step: a shape (token ids) or a pytree of meta
    tensors; with it the report estimates activation memory (`lightning_dpar.estimates.activations`), saying it came
    from `batch_source` (`traces`: traces to reuse across dry runs of the same model). Raises the same errors as
    training for sizes that do not tile the world or plans that do not fit the model."""
    if not isinstance(strategy, DparStrategy):
        raise TypeError(f"`plan` needs a lightning_dpar strategy, got {type(strategy).__name__}.")
    if world_size % num_nodes:
        raise ValueError(f"`world_size={world_size}` is not a multiple of `num_nodes={num_nodes}`.")
    if not 0 <= rank < world_size:
        raise ValueError(f"`rank={rank}` must be in [0, {world_size}).")
    if any(not t.is_meta for t in module.parameters()):
        raise ValueError("`plan` expects a model built on the meta device (`with torch.device('meta'): ...`).")
    if dist.is_initialized():
        raise RuntimeError("`plan` needs a process without a process group (it creates a fake one of N ranks).")
    devices_per_node = world_size // num_nodes
    dims = strategy.resolve_dims(world_size, devices_per_node, num_nodes)  # same validation as training
    init_fake_process_group(rank, world_size)
    try:
        with warnings.catch_warnings():
            # DTensor notes that CPU meshes lack its RNG; a dry run draws no random numbers.
            warnings.filterwarnings("ignore", message=".*DTensor random operators.*")
            return _plan_on_fake_world(
                strategy, module, dims, num_nodes, rank, devices_per_node, batch, batch_source, traces
            )
    finally:
        dist.destroy_process_group()


def _plan_on_fake_world(
    strategy: DparStrategy,
    module: L.LightningModule,
    dims: ParallelDims,
    num_nodes: int,
    rank: int,
    devices_per_node: int,
    batch: Any,
    batch_source: str,
    traces: TraceCache | None,
) -> PlanReport:
    meshes = dims.build_meshes(torch.device("meta"), device_type="cpu")
    attach_device_mesh(module, meshes.world)  # what `LightningModule.device_mesh` returns inside `configure_model`
    with torch.device("meta"):
        module.configure_model()
    module = strategy.precision_plugin.convert_module(module)
    # Each pipeline rank drops the other stages' units, so the other stages are planned on copies of the whole model;
    # activations are traced on the model before parallelism, with the plan's layouts applied to the trace.
    unsplit = _meta_copy(module) if dims.pipeline > 1 or batch is not None else None
    model_params = sum(p.numel() for p in module.parameters())
    applied, module_plan, optimizers, optimizer_error = _apply(strategy, module, dims, rank, meshes)
    notes = []
    if module_plan.adopted:
        notes.append("the model's configure_model applied its own parallelism; it is shown as applied")
    if optimizer_error is not None:  # e.g. configure_optimizers reads self.trainer, which a dry run does not have
        notes.append(f"configure_optimizers could not run without a Trainer ({optimizer_error})")
    pipeline, plans = None, [module_plan]
    if applied.pipeline is not None:
        assert unsplit is not None and module_plan.pipeline is not None
        pipeline, plans = _pipeline_report(strategy, unsplit, dims, rank, meshes, (applied, module_plan, optimizers))
    if getattr(strategy, "cpu_offload", False):
        notes.append(
            "cpu_offload: parameters, gradients and optimizer state below live in CPU memory; the accelerator holds"
            " only the unit being computed (its all-gather)"
        )
    precision = strategy.precision_plugin.precision
    compute_dtype = torch.bfloat16 if precision in ("bf16-mixed", "bf16-true") else None
    if pipeline is not None and strategy.pipeline_config.schedule.defers_weight_gradients:
        gathered = sum(size for _, size in state_memory.gathered_fsdp_units(module, compute_dtype))
        notes.append(
            unsharded_units_note(strategy.pipeline_config.schedule.name, rank, state_memory.format_bytes(gathered))
        )
    activations, activation_note = None, "not estimated: give the batch shape with --batch-size and --seq-len"
    if batch is not None:
        assert unsplit is not None
        activations, activation_note = strategy_activations(strategy, unsplit, plans, dims, batch, traces)
    return PlanReport(
        strategy=type(strategy).__name__,
        dims=dims,
        num_nodes=num_nodes,
        rank=rank,
        coordinate=dict(zip(meshes.world.mesh_dim_names or (), meshes.world.get_coordinate() or ())),
        precision=precision,
        modules=_describe_modules(module, module_plan, strategy.compile_options is not None, dims),
        experts=describe_experts(module, module_plan, dims, meshes.expert_view, rank),
        params=[
            ParamRow(
                name,
                tuple(p.shape),
                _placement(p),
                tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape),
                str(p.dtype).replace("torch.", ""),
            )
            for name, p in module.named_parameters()
        ],
        total_params=sum(p.numel() for p in module.parameters()),
        memory=state_memory.estimate_memory(module, optimizers),
        optimizers=sorted(
            {
                f"{e.optimizer}: {e.states} states/param" if e.states is not None else e.optimizer
                for e in state_memory.optimizer_states(optimizers)
            }
        ),
        largest_unit=state_memory.largest_fsdp_unit(module, compute_dtype),
        notes=notes,
        pipeline=pipeline,
        model_params=model_params if pipeline is not None else None,
        tied=[_describe_tie(module, group, module_plan) for group in module_plan.tied],
        optimizer_exactness=exactness_summary(
            optimizers, strategy.parameter_layout(dims), type(strategy).__name__, strategy._computes_whole_updates
        ),
        activations=activations,
        activation_source=batch_source if activations is not None else "",
        activation_note=activation_note,
    )


def strategy_activations(
    strategy: DparStrategy,
    unsplit: nn.Module,
    plans: list[ModulePlan],
    dims: ParallelDims,
    batch: Any,
    traces: TraceCache | None = None,
) -> tuple[ActivationEstimate | None, str]:
    """The activation estimate of `plans` (one per pipeline rank) on the unparallelised model, in the dtypes and
    pipeline settings of `strategy`, or why there is none (a training step that does not run on fake tensors, a
    batch the microbatches do not divide)."""
    bf16_mixed = strategy.precision_plugin.precision == "bf16-mixed"
    shards = strategy.plan_options.shards  # FSDP2 casts parameters to bf16; the `replicate` wrapper autocasts
    try:
        estimate = estimate_activations(
            unsplit,
            plans,
            dims,
            batch,
            pipeline=strategy.pipeline_config if dims.pipeline > 1 else None,
            compute_dtype=torch.bfloat16 if bf16_mixed and shards else None,
            autocast_dtype=torch.bfloat16 if bf16_mixed and not shards else None,
            traces=traces,
        )
    except Exception as err:  # the dry run reports the rest; the error says why this part is missing
        return None, f"could not be estimated ({type(err).__name__}: {err})"
    return estimate, ""


def _describe_tie(module: nn.Module, group: Sequence[str], module_plan: ModulePlan) -> str:
    """`a.weight = b.weight: tensor parallel Shard(0), FSDP unit net`: what the parallelised model makes of one tied
    parameter (the innermost FSDP unit enclosing all its names holds it)."""
    parts = []
    if module_plan.tensor_parallel:
        parts.append(f"tensor parallel {describe_tp_placement(module, group[0], module_plan.tensor_parallel)}")
    units = [
        fqn or ROOT
        for fqn, sub in module.named_modules()
        if isinstance(sub, FSDPModule) and all(not fqn or name.startswith(f"{fqn}.") for name in group)
    ]
    if units:
        parts.append(f"FSDP unit {units[-1]}")
    return f"  {' = '.join(group)}" + (f": {', '.join(parts)}" if parts else "")


def _meta_copy(module: nn.Module) -> nn.Module:
    """A copy of a meta-device model sharing its device mesh (a mesh holds process groups, which are not copied)."""
    mesh = getattr(module, "device_mesh", None)  # the LightningModule's (attached for `configure_model`)
    return copy.deepcopy(module, memo={id(mesh): mesh} if mesh is not None else None)


def _apply(
    strategy: DparStrategy, module: nn.Module, dims: ParallelDims, rank: int, meshes: ParallelMeshes
) -> tuple[parallelize.AppliedPlan, ModulePlan, list[Optimizer], str | None]:
    """The training code path on `module` as global rank `rank`, minus materialisation; then its optimizers (and
    why they could not be built, if so)."""
    module_plan = strategy.module_plan(module, dims, rank)
    applied = strategy.apply_plan(module, module_plan, meshes, dry_run=True)  # compile units are reported only
    try:
        return applied, module_plan, _optimizers(module.configure_optimizers()), None  # type: ignore[operator]
    except Exception as err:
        return applied, module_plan, [], f"{type(err).__name__}: {err}"


def _pipeline_report(
    strategy: DparStrategy,
    unsplit: nn.Module,
    dims: ParallelDims,
    rank: int,
    meshes: ParallelMeshes,
    shown: tuple[parallelize.AppliedPlan, ModulePlan, list[Optimizer]],
) -> tuple[PipelineReport, list[ModulePlan]]:
    """Every stage's units, ranks and per-rank memory. Each pipeline rank is planned, as training would plan it, on a
    fresh copy of the whole model, at the shown rank's coordinate in the other mesh dims: the same local shapes as
    that rank's pipeline peers hold (meshes are row-major with the pipeline dim outermost). Also returns each
    pipeline rank's local plan."""
    shown_pipeline_rank = pipeline_rank_of(rank, dims.world_size, dims.pipeline)
    rows: list[StageRow] = []
    plans: list[ModulePlan] = []
    for pipeline_rank in range(dims.pipeline):
        if pipeline_rank == shown_pipeline_rank:  # planned already: the report's main sections show it
            applied, local, optimizers = shown
        else:
            copy_rank = peer_rank(rank, pipeline_rank, dims.world_size, dims.pipeline)
            applied, local, optimizers, _ = _apply(strategy, _meta_copy(unsplit), dims, copy_rank, meshes)
        plans.append(local)
        assert applied.pipeline is not None
        split = applied.pipeline.split
        ranks = stage_ranks(pipeline_rank, dims.world_size, dims.pipeline)
        for stage, stage_module in applied.pipeline.stages.items():
            units = split.stages[stage]
            rows.append(
                StageRow(
                    stage=stage,
                    pipeline_rank=pipeline_rank,
                    ranks=ranks,
                    units=units,
                    num_params=sum(p.numel() for unit in units for p in unsplit.get_submodule(unit).parameters()),
                    memory=state_memory.estimate_memory(stage_module, optimizers),
                )
            )
    return PipelineReport.of(strategy.pipeline_config, dims.pipeline, rows), plans
