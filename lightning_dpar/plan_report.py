"""`python -m lightning_dpar plan`: what a strategy will do to a model on N ranks, without launching anything.

The model is built on the meta device (no memory), a fake process group of N ranks stands in for the real one
(collectives do nothing), and the training code path then runs on that model: the strategy's `resolve_dims`,
`build_device_mesh`, the strategy's `module_plan` and `data_parallel_wrapper`, and `parallelize.apply_plan` (tensor
parallel, activation checkpointing, compile, FSDP or replicate), without materialisation. The strategy object is
only read, never changed. The printed placements and local shapes are those of the real run, a bad plan fails
with the error training would raise, and a 65B-parameter plan (`examples/plan/gpt_70b.yaml`) takes seconds on a laptop.

With pipeline parallelism a rank holds only its stages, so the report adds one row per stage (`PipelineReport`):
each pipeline rank is planned the same way on its own meta copy of the model, and its stages' memory is what their
ranks would hold. Llama 3 405B on 1024 ranks (`examples/plan/llama3_405b.yaml`, 16 stages) also takes seconds.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.optim import Optimizer

from lightning_dpar import memory, parallelize
from lightning_dpar._private_api import attach_device_mesh, is_composable_replicated
from lightning_dpar.mesh import TENSOR_PARALLEL, MeshLayout, ParallelDims, build_device_mesh, init_fake_process_group
from lightning_dpar.optimizers import ParameterLayout, exactness_summary
from lightning_dpar.pipeline.split import PipelineSplit
from lightning_dpar.plan import ModulePlan
from lightning_dpar.strategies.base import DparStrategy
from lightning_dpar.ties import describe_layout

__all__ = [
    "ParamRow",
    "PipelineReport",
    "PlanReport",
    "StageRow",
    "main",
    "plan",
]


@dataclass
class ParamRow:
    name: str
    global_shape: tuple[int, ...]
    placement: str
    local_shape: tuple[int, ...]
    dtype: str


@dataclass
class StageRow:
    """One pipeline stage: where it runs, what it holds, and what each of its ranks stores for it."""

    stage: int
    pipeline_rank: int
    ranks: range  # the global ranks holding this stage (one pipeline rank's group)
    units: tuple[str, ...]
    num_params: int  # the stage's parameters, whole (before tensor-parallel and FSDP sharding)
    memory: memory.MemoryEstimate  # on one of `ranks`: the one at the shown rank's data/tensor-parallel coordinate


@dataclass
class PipelineReport:
    """The schedule and the stages, with per-stage memory."""

    schedule: str
    microbatches: int
    microbatches_by_default: bool  # one per stage, as `pipeline_microbatches=None` gives
    stages_per_rank: int
    split: str
    stages: list[StageRow]
    num_ranks: int

    @property
    def bubble(self) -> float | None:
        """The idle fraction of an ideal step (equal stage times, no communication), where the schedule has a known
        closed form: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for Interleaved1F1B (v stages per rank)."""
        p, m, v = self.num_ranks, self.microbatches, self.stages_per_rank
        if self.schedule in ("GPipe", "1F1B"):
            return (p - 1) / (m + p - 1)
        if self.schedule == "Interleaved1F1B":
            return (p - 1) / (v * m + p - 1)
        return None

    def render(self) -> list[str]:
        default = " (default: one per stage)" if self.microbatches_by_default else ""
        stages = f"{self.stages_per_rank} stage{'s' if self.stages_per_rank > 1 else ''}"
        lines = [
            f"Pipeline: schedule {self.schedule}, {self.microbatches} microbatches per batch{default},"
            f" {stages} per pipeline rank, split {self.split}",
            f"  each data-parallel rank's batch size must be a multiple of {self.microbatches}",
        ]
        if self.bubble is not None:
            lines.append(
                f"  bubble (idle fraction of an ideal step): {self.bubble:.0%}; more microbatches make it smaller"
            )
        rows = [
            (
                str(row.stage),
                str(row.pipeline_rank),
                _ranks(row.ranks),
                _describe_units(row.units),
                f"{row.num_params:,}",
                memory.format_bytes(row.memory.parameters),
                memory.format_bytes(row.memory.gradients),
                memory.format_bytes(row.memory.optimizer) if row.memory.optimizer is not None else "unknown",
                memory.format_bytes(row.memory.total),
            )
            for row in self.stages
        ]
        header = ("stage", "pipeline rank", "ranks", "units", "parameters", "params/rank", "grads/rank")
        lines += _table(rows, (*header, "optimizer/rank", "total/rank"))
        if self.stages_per_rank > 1:
            for pipeline_rank in range(self.num_ranks):
                held = [row for row in self.stages if row.pipeline_rank == pipeline_rank]
                total = sum(row.memory.total for row in held)
                lines.append(
                    f"  pipeline rank {pipeline_rank} holds stages {', '.join(str(r.stage) for r in held)}:"
                    f" {memory.format_bytes(total)} per rank"
                )
        return lines


@dataclass
class PlanReport:
    """Everything `plan` prints; `render()` formats it."""

    strategy: str
    dims: ParallelDims
    num_nodes: int
    rank: int
    coordinate: dict[str, int]
    precision: str
    modules: dict[str, list[str]]  # fqn -> what is applied to it
    params: list[ParamRow]
    total_params: int
    memory: memory.MemoryEstimate
    optimizers: list[str]
    largest_unit: tuple[str, int] | None  # (fqn, bytes all-gathered for compute)
    notes: list[str] = field(default_factory=list)
    pipeline: PipelineReport | None = None
    model_params: int | None = None  # the whole model's, when this rank holds only some pipeline stages
    tied: list[str] = field(default_factory=list)  # one line per parameter reachable under several names
    optimizer_exactness: list[str] = field(default_factory=list)  # per optimizer: exact here, or refused and why

    def render(self, all_params: bool = False) -> str:
        d = self.dims
        lines = [
            f"{self.strategy} on {d.world_size} ranks ({self.num_nodes} node(s) x {d.world_size // self.num_nodes}"
            f" devices), precision {self.precision}, showing rank {self.rank}",
            "",
            "Mesh",
            f"  {d.describe()}; data_parallel = {d.data_parallel} (ranks that see different batches)",
            f"  rank {self.rank} is at " + ", ".join(f"{k}={v}" for k, v in self.coordinate.items()),
        ]
        if self.pipeline is not None:
            lines += ["", *self.pipeline.render()]
            lines += ["", f"Modules on rank {self.rank} (its pipeline stages only)"]
        else:
            lines += ["", "Modules"]
        lines += _table(
            [(name, ", ".join(what), f"x{n}" if n > 1 else "") for name, what, n in _group_modules(self.modules)],
            ("module", "applied", ""),
        ) or ["  (nothing: every parameter stays whole on every rank)"]
        if self.tied:
            lines += ["", "Tied parameters (one parameter under several names, listed once below)", *self.tied]
        held = f"{self.total_params:,} in total"
        if self.model_params is not None:
            held = f"{self.total_params:,} of the model's {self.model_params:,}"
        lines += ["", f"Parameters on rank {self.rank} ({held})"]
        rows = [(r.name, _shape(r.global_shape), r.placement, _shape(r.local_shape), r.dtype, "") for r in self.params]
        if not all_params:
            rows = _group_params(self.params)
        lines += _table(rows, ("parameter", "global shape", "placement", "local shape", "dtype", ""))
        m = self.memory
        optimizer = (
            memory.format_bytes(m.optimizer)
            if m.optimizer is not None
            else f"unknown ({', '.join(m.unknown_optimizers)} not in lightning_dpar.memory.STATES_PER_PARAMETER)"
        )
        lines += [
            "",
            f"Estimated memory on rank {self.rank} (see lightning_dpar.memory for the formula)",
            f"  parameters  {memory.format_bytes(m.parameters)}{memory.frozen_note(m)}",
            f"  gradients   {memory.format_bytes(m.gradients)}",
            f"  optimizer   {optimizer}   [{'; '.join(self.optimizers) or 'no optimizer'}]",
            f"  total       {memory.format_bytes(m.total)}",
        ]
        if self.largest_unit:
            fqn, size = self.largest_unit
            lines.append(f"  + the largest FSDP unit all-gathered for compute: {memory.format_bytes(size)} ({fqn})")
        lines.append("  not included: activations, communication buffers, allocator overhead")
        if self.optimizer_exactness:
            lines += ["", "Optimizers under this layout (exact as under DDP, or refused before training)"]
            lines += [f"  {line}" for line in self.optimizer_exactness]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> list[str]:
    if not rows:
        return []
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return ["  " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]


def _ranks(ranks: range) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def _describe_units(units: Sequence[str]) -> str:
    """`model.emb, model.blocks.0, model.blocks.1, model.blocks.2` -> `model.emb, model.blocks.0-2`."""
    runs: list[tuple[str, int, int] | str] = []
    for fqn in units:
        prefix, _, index = fqn.rpartition(".")
        last = runs[-1] if runs else None
        if prefix and index.isdigit():
            if isinstance(last, tuple) and last[0] == prefix and last[2] == int(index) - 1:
                runs[-1] = (prefix, last[1], int(index))
            else:
                runs.append((prefix, int(index), int(index)))
        else:
            runs.append(fqn)
    return ", ".join(
        run if isinstance(run, str) else f"{run[0]}.{run[1]}" + (f"-{run[2]}" if run[2] > run[1] else "")
        for run in runs
    )


#: How the report names the LightningModule itself.
ROOT = "(the LightningModule)"

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


def _group_modules(modules: dict[str, list[str]]) -> list[tuple[str, list[str], int]]:
    """Collapse `blocks.0.x`, `blocks.1.x`, ... that get the same treatment into `blocks.*.x  xN`."""
    groups: dict[tuple[str, tuple[str, ...]], int] = {}
    for fqn, what in modules.items():
        key = (_INDEX.sub("*", fqn), tuple(what))
        groups[key] = groups.get(key, 0) + 1
    return [(name, list(what), n) for (name, what), n in groups.items()]


def _group_params(params: list[ParamRow]) -> list[tuple[str, ...]]:
    groups: dict[tuple[str, ...], int] = {}
    for r in params:
        key = (_INDEX.sub("*", r.name), _shape(r.global_shape), r.placement, _shape(r.local_shape), r.dtype)
        groups[key] = groups.get(key, 0) + 1
    return [(*key, f"x{n}" if n > 1 else "") for key, n in groups.items()]


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


def _describe_modules(module: nn.Module, plan: ModulePlan, compiling: bool) -> dict[str, list[str]]:
    described: dict[str, list[str]] = {}
    for fqn, style in plan.tensor_parallel.items():
        described.setdefault(fqn, []).append(f"TP {describe_style(style)}")
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


def _gathered_fsdp_units(module: nn.Module, compute_dtype: torch.dtype | None) -> list[tuple[str, int]]:
    """Each FSDP unit's own parameters (not nested units') once all-gathered for compute (TP shards stay), in
    bytes."""
    sizes = []
    for fqn, unit in module.named_modules():
        if not isinstance(unit, FSDPModule):
            continue
        nested = {
            id(p)
            for _, sub in unit.named_modules()
            if sub is not unit and isinstance(sub, FSDPModule)
            for p in sub.parameters()
        }
        size = sum(
            memory.unsharded_numel(p, [TENSOR_PARALLEL])
            * (p.element_size() if compute_dtype is None else compute_dtype.itemsize)
            for p in unit.parameters()
            if id(p) not in nested
        )
        sizes.append((fqn, size))
    return sizes


def _largest_fsdp_unit(module: nn.Module, compute_dtype: torch.dtype | None) -> tuple[str, int] | None:
    """The FSDP unit whose own parameters are largest once all-gathered."""
    return max(_gathered_fsdp_units(module, compute_dtype), key=lambda unit: unit[1], default=None)


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
) -> PlanReport:
    """Apply `strategy` to `module` (built on the meta device) as rank `rank` of `world_size` would, and report.

    Raises the same errors as training for sizes that do not tile the world or plans that do not fit the model.
    """
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
            return _plan_on_fake_world(strategy, module, dims, num_nodes, rank, devices_per_node)
    finally:
        dist.destroy_process_group()


def _plan_on_fake_world(
    strategy: DparStrategy,
    module: L.LightningModule,
    dims: ParallelDims,
    num_nodes: int,
    rank: int,
    devices_per_node: int,
) -> PlanReport:
    mesh, data_parallel_mesh = build_device_mesh(dims, "cpu")
    attach_device_mesh(module, mesh)  # what `LightningModule.device_mesh` returns inside `configure_model`
    with torch.device("meta"):
        module.configure_model()
    module = strategy.precision_plugin.convert_module(module)
    # Each pipeline rank drops the other stages' units, so the other stages are planned on copies of the whole model.
    unsplit = _meta_copy(module) if dims.pipeline > 1 else None
    model_params = sum(p.numel() for p in module.parameters())
    layout = MeshLayout(dims, mesh, data_parallel_mesh, torch.device("meta"))
    applied, plan_, optimizers, optimizer_error = _apply(strategy, module, dims, rank, layout)
    notes = []
    if plan_.adopted:
        notes.append("the model's configure_model applied its own parallelism; it is shown as applied")
    if optimizer_error is not None:  # e.g. configure_optimizers reads self.trainer, which a dry run does not have
        notes.append(f"configure_optimizers could not run without a Trainer ({optimizer_error})")
    pipeline = None
    if applied.pipeline is not None:
        assert unsplit is not None and plan_.pipeline is not None
        pipeline = _pipeline_report(strategy, unsplit, dims, rank, layout, (applied, optimizers))
    if getattr(strategy, "cpu_offload", False):
        notes.append(
            "cpu_offload: parameters, gradients and optimizer state below live in CPU memory; the accelerator holds"
            " only the unit being computed (its all-gather)"
        )
    precision = strategy.precision_plugin.precision
    compute_dtype = torch.bfloat16 if precision in ("bf16-mixed", "bf16-true") else None
    if pipeline is not None and strategy.pipeline_config.schedule.defers_weight_gradients:
        gathered = sum(size for _, size in _gathered_fsdp_units(module, compute_dtype))
        notes.append(
            f"{strategy.pipeline_config.schedule.name} keeps every FSDP unit of a stage unsharded from forward to"
            f" backward: rank {rank}'s stages all-gathered, {memory.format_bytes(gathered)}, stay in memory during"
            " a step, in place of the one unit above"
        )
    return PlanReport(
        strategy=type(strategy).__name__,
        dims=dims,
        num_nodes=num_nodes,
        rank=rank,
        coordinate=dict(zip(mesh.mesh_dim_names or (), mesh.get_coordinate() or ())),
        precision=precision,
        modules=_describe_modules(module, plan_, strategy.compile_options is not None),
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
        memory=memory.estimate_memory(module, optimizers),
        optimizers=sorted(
            {
                f"{e.optimizer}: {e.states} states/param" if e.states is not None else e.optimizer
                for e in memory.optimizer_states(optimizers)
            }
        ),
        largest_unit=_largest_fsdp_unit(module, compute_dtype),
        notes=notes,
        pipeline=pipeline,
        model_params=model_params if pipeline is not None else None,
        tied=[_describe_tie(module, group, plan_) for group in plan_.tied],
        optimizer_exactness=exactness_summary(
            optimizers, ParameterLayout.of(dims), type(strategy).__name__, strategy._computes_whole_updates
        ),
    )


def _describe_tie(module: nn.Module, group: Sequence[str], plan_: ModulePlan) -> str:
    """`a.weight = b.weight: tensor parallel Shard(0), FSDP unit net`: what the parallelised model makes of one tied
    parameter (the innermost FSDP unit enclosing all its names holds it)."""
    parts = []
    if plan_.tensor_parallel:
        parts.append(f"tensor parallel {describe_layout(module, group[0], plan_.tensor_parallel)}")
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
    strategy: DparStrategy, module: nn.Module, dims: ParallelDims, rank: int, layout: MeshLayout
) -> tuple[parallelize.AppliedPlan, ModulePlan, list[Optimizer], str | None]:
    """The training code path on `module` as global rank `rank`, minus materialisation; then its optimizers (and
    why they could not be built, if so)."""
    plan_ = strategy.module_plan(module, dims, rank)
    applied = parallelize.apply_plan(
        module,
        plan_,
        tensor_parallel_mesh=layout.mesh[TENSOR_PARALLEL],
        wrap_data_parallel=strategy.data_parallel_wrapper(layout),
        compile_options=None,  # compile units are reported; compiling is lazy and would do nothing here
    )
    try:
        return applied, plan_, _optimizers(module.configure_optimizers()), None  # type: ignore[operator]
    except Exception as err:
        return applied, plan_, [], f"{type(err).__name__}: {err}"


def _pipeline_report(
    strategy: DparStrategy,
    unsplit: nn.Module,
    dims: ParallelDims,
    rank: int,
    layout: MeshLayout,
    shown: tuple[parallelize.AppliedPlan, list[Optimizer]],
) -> PipelineReport:
    """Every stage's units, ranks and per-rank memory. Each pipeline rank is planned, as training would plan it, on a
    fresh copy of the whole model, at the shown rank's coordinate in the other mesh dims: the same local shapes as
    that rank's pipeline peers hold (meshes are row-major with the pipeline dim outermost)."""
    ranks_per_stage = dims.world_size // dims.pipeline
    shown_pipeline_rank, offset = divmod(rank, ranks_per_stage)
    config = strategy.pipeline_config
    rows: list[StageRow] = []
    split: PipelineSplit | None = None
    for pipeline_rank in range(dims.pipeline):
        if pipeline_rank == shown_pipeline_rank:  # planned already: the report's main sections show it
            applied, optimizers = shown
        else:
            copy_rank = pipeline_rank * ranks_per_stage + offset
            applied, _, optimizers, _ = _apply(strategy, _meta_copy(unsplit), dims, copy_rank, layout)
        assert applied.pipeline is not None
        split = applied.pipeline.split
        ranks = range(pipeline_rank * ranks_per_stage, (pipeline_rank + 1) * ranks_per_stage)
        for stage, stage_module in applied.pipeline.stages.items():
            units = split.stages[stage]
            rows.append(
                StageRow(
                    stage=stage,
                    pipeline_rank=pipeline_rank,
                    ranks=ranks,
                    units=units,
                    num_params=sum(p.numel() for unit in units for p in unsplit.get_submodule(unit).parameters()),
                    memory=memory.estimate_memory(stage_module, optimizers),
                )
            )
    assert split is not None
    return PipelineReport(
        schedule=config.schedule.name,
        microbatches=config.num_microbatches(dims.pipeline),
        microbatches_by_default=config.microbatches is None,
        stages_per_rank=config.stages_per_rank,
        split="'auto'" if config.split == "auto" else f"at {list(config.split)}",
        stages=sorted(rows, key=lambda row: row.stage),
        num_ranks=dims.pipeline,
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m lightning_dpar plan [--world-size N] [--num-nodes M] [--rank R] [CLI args such as --config F]`."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_dpar plan",
        description="Print the mesh, per-module plan, parameter placements and per-rank memory of a configuration"
        " without launching processes or allocating the model. Other arguments (--config FILE, --trainer.*,"
        " --model.*) are read as by `python -m lightning_dpar fit`.",
    )
    parser.add_argument("--world-size", type=int, help="ranks to plan for (default: trainer devices x num_nodes)")
    parser.add_argument("--num-nodes", type=int, help="nodes the ranks span (default: trainer num_nodes)")
    parser.add_argument("--rank", type=int, default=0, help="whose shards to show (default: 0, the largest)")
    parser.add_argument("--all-params", action="store_true", help="one line per parameter (no x N grouping)")
    args, cli_args = parser.parse_known_args(argv)
    from lightning_dpar.cli import cli_main

    with warnings.catch_warnings():
        # Expected: the CLI is given `plan`'s leftover arguments rather than sys.argv.
        warnings.filterwarnings("ignore", message=".*args parameter is intended.*")
        cli = cli_main(cli_args, run=False, model_on_meta=True)
    trainer = cli.trainer
    num_nodes = args.num_nodes or trainer.num_nodes
    world_size = args.world_size or trainer.num_devices * num_nodes
    try:
        report = plan(trainer.strategy, cli.model, world_size, num_nodes, args.rank)
    except (ValueError, TypeError) as err:
        print(f"plan failed: {err}", file=sys.stderr)
        return 1
    print(report.render(all_params=args.all_params))
    return 0
