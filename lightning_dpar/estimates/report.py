"""What the dry run reports, and how it prints: the report types (`PlanReport`, with `PipelineReport` and its
`StageRow`s under pipeline parallelism, the pipeline folder's section, `lightning_dpar.pipeline.report`, exported here
too) and their `render()`, which groups repeated blocks (`blocks.*.x  xN`) into aligned tables. Filled in by
`lightning_dpar.estimates.dry_run`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import lightning_dpar.estimates.state_memory as state_memory
from lightning_dpar.activation_checkpointing.estimate import CHECKPOINTING_NAMES
from lightning_dpar.activation_checkpointing.step import CHECKPOINTING_SETTINGS
from lightning_dpar.estimates.activations import ActivationEstimate
from lightning_dpar.helpers import group_modules, text_table, wildcard_indices
from lightning_dpar.loss_parallel.estimate import describe_sharded_logits
from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.pipeline.estimate import describe_in_flight, pipeline_rank_of
from lightning_dpar.pipeline.report import PipelineReport, StageRow

__all__ = ["ROOT", "ParamRow", "PipelineReport", "PlanReport", "StageRow"]


@dataclass
class ParamRow:
    """One parameter as the shown rank holds it: its shape whole and local, its placement on the mesh, its dtype."""

    name: str
    global_shape: tuple[int, ...]
    placement: str
    local_shape: tuple[int, ...]
    dtype: str


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
        lines += text_table(
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
        lines += text_table(rows, ("parameter", "global shape", "placement", "local shape", "dtype", ""))
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
    lines += text_table(rows, ("", "kept for backward", "peak in the step", "recomputed FLOPs", ""))
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


#: How the report names the LightningModule itself.
ROOT = "(the LightningModule)"


def _group_params(params: list[ParamRow]) -> list[tuple[str, ...]]:
    groups: dict[tuple[str, ...], int] = {}
    for r in params:
        key = (wildcard_indices(r.name), _shape(r.global_shape), r.placement, _shape(r.local_shape), r.dtype)
        groups[key] = groups.get(key, 0) + 1
    return [(*key, f"x{n}" if n > 1 else "") for key, n in groups.items()]
