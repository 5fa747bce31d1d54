"""What the dry run reports, and how it prints: the report types (`PlanReport`, with `PipelineReport` and its
`StageRow`s under pipeline parallelism) and their `render()`, which groups repeated blocks (`blocks.*.x  xN`) into
aligned tables. Filled in by `lightning_dpar.estimates.dry_run`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import lightning_dpar.estimates.state_memory as state_memory
from lightning_dpar.activation_checkpointing.estimate import CHECKPOINTING_NAMES
from lightning_dpar.activation_checkpointing.step import CHECKPOINTING_SETTINGS
from lightning_dpar.estimates.activations import ActivationEstimate
from lightning_dpar.helpers import group_modules, wildcard_indices
from lightning_dpar.loss_parallel.estimate import describe_sharded_logits
from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.pipeline.estimate import (
    describe_in_flight,
    describe_rank_stages,
    describe_schedule,
    pipeline_rank_of,
)
from lightning_dpar.pipeline.schedule import schedule_spec

__all__ = ["ROOT", "ParamRow", "PipelineReport", "PlanReport", "StageRow", "group_modules"]


@dataclass
class ParamRow:
    """One parameter as the shown rank holds it: its shape whole and local, its placement on the mesh, its dtype."""

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
    memory: (
        state_memory.MemoryEstimate
    )  # on one of `ranks`: the one at the shown rank's data/tensor-parallel coordinate


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
        """The idle fraction of an ideal step, where the schedule has a known closed form
        (`ScheduleSpec.bubble`)."""
        return schedule_spec(self.schedule).bubble(self.num_ranks, self.microbatches, self.stages_per_rank)

    def render(self, activations: ActivationEstimate | None = None) -> list[str]:
        lines = describe_schedule(
            self.schedule,
            self.microbatches,
            self.microbatches_by_default,
            self.stages_per_rank,
            self.split,
            self.bubble,
        )
        rows = [
            (
                str(row.stage),
                str(row.pipeline_rank),
                _ranks(row.ranks),
                _describe_units(row.units),
                f"{row.num_params:,}",
                state_memory.format_bytes(row.memory.parameters),
                state_memory.format_bytes(row.memory.gradients),
                state_memory.format_bytes(row.memory.optimizer) if row.memory.optimizer is not None else "unknown",
                state_memory.format_bytes(row.memory.total),
                *([state_memory.format_bytes(activations.peak(row.pipeline_rank))] if activations is not None else []),
            )
            for row in self.stages
        ]
        header = ("stage", "pipeline rank", "ranks", "units", "parameters", "params/rank", "grads/rank")
        header += ("optimizer/rank", "total/rank", *(["activations/rank"] if activations is not None else []))
        lines += _table(rows, header)
        if self.stages_per_rank > 1:
            for pipeline_rank in range(self.num_ranks):
                held = [row for row in self.stages if row.pipeline_rank == pipeline_rank]
                total = state_memory.format_bytes(sum(row.memory.total for row in held))
                lines.append(describe_rank_stages(pipeline_rank, [row.stage for row in held], total))
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
    memory: state_memory.MemoryEstimate
    optimizers: list[str]
    largest_unit: tuple[str, int] | None  # (fqn, bytes all-gathered for compute)
    notes: list[str] = field(default_factory=list)
    pipeline: PipelineReport | None = None
    model_params: int | None = None  # the whole model's, when this rank holds only some pipeline stages
    tied: list[str] = field(default_factory=list)  # one line per parameter reachable under several names
    optimizer_exactness: list[str] = field(default_factory=list)  # per optimizer: exact here, or refused and why
    experts: list[str] = field(default_factory=list)  # with expert parallelism: who holds which experts
    activations: ActivationEstimate | None = None
    activation_source: str = ""  # where the batch shape came from
    activation_note: str = ""  # why there is no estimate

    @property
    def pipeline_rank(self) -> int:
        return pipeline_rank_of(self.rank, self.dims.world_size, self.dims.pipeline)

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
            lines += ["", *self.pipeline.render(self.activations)]
            lines += ["", f"Modules on rank {self.rank} (its pipeline stages only)"]
        else:
            lines += ["", "Modules"]
        lines += _table(
            [(name, ", ".join(what), f"x{n}" if n > 1 else "") for name, what, n in group_modules(self.modules)],
            ("module", "applied", ""),
        ) or ["  (nothing: every parameter stays whole on every rank)"]
        if self.experts:
            lines += ["", f"Experts (expert parallel {d.expert}: the experts of each MoE layer split between ranks)"]
            lines += self.experts
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
            state_memory.format_bytes(m.optimizer)
            if m.optimizer is not None
            else f"unknown ({', '.join(m.unknown_optimizers)} not in"
            " lightning_dpar.estimates.state_memory.STATES_PER_PARAMETER)"
        )
        lines += [
            "",
            f"Estimated memory on rank {self.rank} (see lightning_dpar.estimates.state_memory and"
            " lightning_dpar.estimates.activations)",
            f"  parameters  {state_memory.format_bytes(m.parameters)}{state_memory.frozen_note(m)}",
            f"  gradients   {state_memory.format_bytes(m.gradients)}",
            f"  optimizer   {optimizer}   [{'; '.join(self.optimizers) or 'no optimizer'}]",
            f"  total       {state_memory.format_bytes(m.total)}",
        ]
        peak = m.total
        if self.largest_unit:
            fqn, size = self.largest_unit
            lines.append(
                f"  + the largest FSDP unit all-gathered for compute: {state_memory.format_bytes(size)} ({fqn})"
            )
            peak += size
        if self.activations is None:
            lines.append(f"  activations {self.activation_note}")
            lines.append("  not included: activations, communication buffers, allocator overhead")
        else:
            a = self.activations
            lines.append(
                f"  + activations at their peak: {state_memory.format_bytes(a.peak(self.pipeline_rank))}"
                f" ({CHECKPOINTING_NAMES[a.checkpointing]}; below)"
            )
            peak += a.peak(self.pipeline_rank)
            lines.append(f"  peak        {state_memory.format_bytes(peak)}")
            lines.append("  not included: communication buffers, allocator overhead")
            lines += ["", *_render_activations(a, self.pipeline_rank, self.activation_source)]
        if self.optimizer_exactness:
            lines += ["", "Optimizers under this layout (exact as under DDP, or refused before training)"]
            lines += [f"  {line}" for line in self.optimizer_exactness]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _render_activations(estimate: ActivationEstimate, pipeline_rank: int, source: str) -> list[str]:
    """Per microbatch, without and with activation checkpointing (the plan's marked), then the microbatches in
    flight."""
    rank = estimate.rank(pipeline_rank)
    where = f"pipeline rank {pipeline_rank}'s ranks" if len(estimate.ranks) > 1 else "each rank"
    lines = [
        f"Activations on {where}, per microbatch: {estimate.microbatch}" + (f" ({source})" if source else ""),
    ]
    rows = []
    for checkpointing in CHECKPOINTING_SETTINGS:
        footprint = rank.per_microbatch(checkpointing)
        flops = estimate.flops
        rows.append(
            (
                CHECKPOINTING_NAMES[checkpointing],
                state_memory.format_bytes(footprint.retained),
                state_memory.format_bytes(footprint.peak),
                f"{flops.recomputed_fraction(checkpointing):.0%}" if flops is not None else "?",
                "<- the plan" if checkpointing == estimate.checkpointing else "",
            )
        )
    lines += _table(rows, ("", "kept for backward", "peak in the step", "recomputed FLOPs", ""))
    groups = group_modules({fqn: [] for fqn in estimate.checkpointed})
    described = ", ".join(name + (f" x{n}" if n > 1 else "") for name, _, n in groups)
    lines.append(f"  checkpointing {described or 'nothing (no repeated blocks)'}")
    if estimate.tensor_parallel > 1:
        lines.append(f"  tensor parallel: sharded activations split over {estimate.tensor_parallel} ranks")
    if estimate.loss_parallel is not None:
        lines.append(describe_sharded_logits(estimate.loss_parallel))
    if estimate.schedule is not None:
        buffers = state_memory.format_bytes(rank.receive_buffers)
        peak = state_memory.format_bytes(rank.peak(estimate.checkpointing))
        lines.append(
            describe_in_flight(
                estimate.schedule, estimate.microbatches, rank.in_flight, rank.in_flight_known, buffers, peak
            )
        )
    lines += [f"  note: {note}" for note in estimate.notes]
    return lines


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


def _group_params(params: list[ParamRow]) -> list[tuple[str, ...]]:
    groups: dict[tuple[str, ...], int] = {}
    for r in params:
        key = (wildcard_indices(r.name), _shape(r.global_shape), r.placement, _shape(r.local_shape), r.dtype)
        groups[key] = groups.get(key, 0) + 1
    return [(*key, f"x{n}" if n > 1 else "") for key, n in groups.items()]
