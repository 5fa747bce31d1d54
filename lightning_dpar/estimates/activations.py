"""Activation memory per rank, per microbatch, with and without activation checkpointing, for any layout: measured
by running one training step on fake tensors (`lightning_dpar.estimates.activation_trace`), never from a formula of the
model's shapes. Pure: no process group, no allocation; the `plan` dry run and a layout search call it alike.

What is counted, per microbatch, on one rank (`Footprint`):

- `retained`: the bytes the step's forward leaves alive for its backward (what autograd saved, the inputs an
  activation-checkpointed block keeps, the loss's saved log-probabilities, ...);
- `peak`: the most bytes alive at any point of the forward and backward: `retained` plus the backward's working set
  (activation gradients, and under activation checkpointing one block's recomputed activations at a time).

Each figure comes three ways (`Checkpointing`): without activation checkpointing (`False`), with full checkpointing
(`True`: each checkpointed block keeps only its input) and with selective checkpointing (`"selective"`: each keeps
its matmul and attention outputs too, `lightning_dpar.activation_checkpointing.policy`), which sits between them. The
FLOPs each recomputes are counted on the same traces (`StepFlops`, `lightning_dpar.activation_checkpointing.estimate`):
a step's FLOPs with checkpointing less those without, which are the ops the backward runs again (a kept op's output is
handed back, not recomputed).

Parameters, their gradients and FSDP's all-gathered units are not activations (`lightning_dpar.estimates.state_memory`
counts them).

Layouts:

- data parallel (DDP, FSDP, HSDP): each rank runs its own batch; the activations are those of that batch;
- tensor parallel: a storage is split over the TP ranks where the plan's styles make it a shard (the outputs of a
  column-wise Linear and what is computed from them, a sequence-parallel region's tokens), whole where a rank holds
  all of it (the input of a column-wise Linear, the all-reduced output of a row-wise one);
- pipeline: each stage holds the activations of its own units, and the schedule decides how many microbatches are
  in flight at once (`ScheduleSpec.microbatches_in_flight`); torch's `PipelineStage` also allocates, once for every
  microbatch, a buffer for the activation a stage receives and one for the gradient it receives, and keeps them. A
  rank's activation peak is `sum over its stages of (in_flight x retained + m x (received + sent)) + the largest
  (peak - retained)` (`RankActivations.peak`, by `lightning_dpar.pipeline.estimate.rank_activation_peak`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_dpar._private_api import tree_leaves, tree_map
from lightning_dpar.activation_checkpointing.estimate import StepFlops, figure_of
from lightning_dpar.activation_checkpointing.step import Checkpointing, CheckpointPolicyName, checkpointing_of
from lightning_dpar.estimates.activation_trace import StepTrace, trace_step, training_loss
from lightning_dpar.loss_parallel.step import sharded_output_styles
from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.pipeline.config import PipelineConfig
from lightning_dpar.pipeline.estimate import (
    in_flight_not_modelled_note,
    microbatches_in_flight,
    rank_activation_peak,
    receive_buffer_bytes,
    unit_indices,
)
from lightning_dpar.plan import ModulePlan, repeated_blocks, resolve_activation_checkpointing

__all__ = [
    "ActivationEstimate",
    "Footprint",
    "RankActivations",
    "StageActivations",
    "StepFlops",
    "TraceCache",
    "estimate_activations",
    "footprint",
    "microbatch_of",
    "unit_input_bytes",
]


#: Traces kept across estimates (a layout search estimates many layouts of one model): a trace depends only on the
#: model, the microbatch, the tensor-parallel styles (not the TP size: `footprint` divides split storages), the
#: checkpointed modules, the pipeline units and the dtypes, which `_trace_key` names.
TraceCache = dict[tuple[Any, ...], StepTrace]


@dataclass(frozen=True)
class Footprint:
    """Activation bytes of one microbatch on one rank: kept from its forward for its backward, and at most."""

    retained: int
    peak: int

    def __add__(self, other: Footprint) -> Footprint:
        """Two stages of one rank, one microbatch each: their retained bytes add up, and the larger working set
        (peak above retained) comes on top, since a rank computes one stage at a time."""
        work = max(self.peak - self.retained, other.peak - other.retained)
        return Footprint(self.retained + other.retained, self.retained + other.retained + work)


@dataclass(frozen=True)
class StageActivations:
    """One pipeline stage (the whole model without pipeline parallelism): one microbatch's activations on each of
    its ranks, without and with (full) activation checkpointing, with selective checkpointing (`None`: not traced,
    then the full figure stands in), and the bytes of one microbatch's activation it receives from the stage before
    and sends to the stage after (0 for the first and the last stage)."""

    stage: int
    without_checkpointing: Footprint
    with_checkpointing: Footprint
    received: int = 0
    sent: int = 0
    selective_checkpointing: Footprint | None = None

    def own(self, checkpointing: Checkpointing) -> Footprint:
        """The stage's own activations under `checkpointing`."""
        return figure_of(
            checkpointing, self.without_checkpointing, self.with_checkpointing, self.selective_checkpointing
        )

    def footprint(self, checkpointing: Checkpointing) -> Footprint:
        """One microbatch: the stage's own activations and the activation it received, which its backward needs."""
        own = self.own(checkpointing)
        return Footprint(own.retained + self.received, own.peak + self.received)


@dataclass(frozen=True)
class RankActivations:
    """What one pipeline rank (every rank, without pipeline parallelism) holds: its stages, how many microbatches
    each has in flight at once at most (`in_flight_known` False: the schedule's count is not modelled, and every
    microbatch is assumed in flight, an upper bound), and the step's `microbatches`."""

    pipeline_rank: int
    stages: tuple[StageActivations, ...]
    in_flight: tuple[int, ...]
    in_flight_known: bool = True
    microbatches: int = 1

    def per_microbatch(self, checkpointing: Checkpointing) -> Footprint:
        """One microbatch on each of the rank's stages."""
        each = [stage.footprint(checkpointing) for stage in self.stages]
        total = each[0]
        for other in each[1:]:
            total = total + other
        return total

    def peak(self, checkpointing: Checkpointing) -> int:
        """The rank's activation peak over a step: every microbatch in flight keeps the stage's own retained bytes,
        and one stage's backward working set comes on top. Pipelining adds what torch's `PipelineStage` allocates
        once for every microbatch and keeps: a buffer for the activation received from the stage before (the input
        its backward needs) and one for the gradient received from the stage after."""
        own = [stage.own(checkpointing) for stage in self.stages]
        return rank_activation_peak(self.in_flight, own, self.receive_buffers)

    @property
    def receive_buffers(self) -> int:
        """Bytes of the pipeline's receive buffers on this rank: for each of its stages and every microbatch, the
        activation from the stage before and the gradient from the stage after (0 without pipelining)."""
        return receive_buffer_bytes(self.microbatches, [(stage.received, stage.sent) for stage in self.stages])


@dataclass(frozen=True)
class ActivationEstimate:
    """Activation memory per rank for one layout and microbatch.

    `microbatch` describes what one `training_step` call receives; `checkpointing` says whether the plan checkpoints
    (so which of the two figures training will see); `checkpointed` names the modules the "with checkpointing"
    figures checkpoint (the plan's, or those `activation_checkpointing=True` would choose); `ranks` has one entry per
    pipeline rank (one without pipeline parallelism); `loss_parallel` names the output layer whose logits are traced
    sharded over the vocabulary (`loss_parallel=True`), `None` if they are gathered."""

    microbatch: str
    checkpointing: Checkpointing
    checkpointed: tuple[str, ...]
    tensor_parallel: int
    ranks: tuple[RankActivations, ...]
    schedule: str | None = None
    microbatches: int = 1
    notes: tuple[str, ...] = ()
    flops: StepFlops | None = None
    loss_parallel: str | None = None

    def rank(self, pipeline_rank: int = 0) -> RankActivations:
        return self.ranks[pipeline_rank]

    def peak(self, pipeline_rank: int = 0, checkpointing: Checkpointing | None = None) -> int:
        """The activation peak of a step on `pipeline_rank`'s ranks, with the plan's checkpointing by default."""
        return self.rank(pipeline_rank).peak(self.checkpointing if checkpointing is None else checkpointing)


def footprint(trace: StepTrace, units: Sequence[int] | None, tensor_parallel: int) -> Footprint:
    """The retained and peak bytes of one traced microbatch on one rank, counting the storages created by `units`
    (indices into `trace.units`; `None`: all) with split storages divided over `tensor_parallel` ranks."""
    chosen = None if units is None else set(units)
    delta: dict[int, int] = {}
    retained = 0
    for life in trace.storages:
        if life.gradient or (chosen is not None and life.unit not in chosen):
            continue
        size = -(-life.nbytes // tensor_parallel) if life.split else life.nbytes
        delta[life.created] = delta.get(life.created, 0) + size
        if life.freed is not None:
            delta[life.freed] = delta.get(life.freed, 0) - size
        retained += size if life.alive_at(trace.forward_end) else 0
    live = peak = 0
    for tick in sorted(delta):
        live += delta[tick]
        peak = max(peak, live)
    return Footprint(retained, peak)


def unit_input_bytes(trace: StepTrace, unit: int, tensor_parallel: int) -> int:
    """One rank's bytes of the activation unit `unit` receives (a pipeline stage boundary's when `unit` starts a
    stage): 0 for the first unit, or one whose input was not traced."""
    if unit <= 0 or unit >= len(trace.unit_inputs) or trace.unit_inputs[unit] is None:
        return 0
    size, split = trace.unit_inputs[unit]
    return -(-size // tensor_parallel) if split else size


def microbatch_of(batch: Any, microbatches: int) -> Any:
    """One of `microbatches` equal parts of `batch` along its first dim (a shape tuple, or a pytree of tensors), as
    the pipeline schedule splits a batch; a batch that does not split evenly is refused as training refuses it."""

    def part(size: int) -> int:
        if size % microbatches:
            raise ValueError(
                f"a batch of {size} does not split into `pipeline_microbatches={microbatches}` equal microbatches"
            )
        return size // microbatches

    if isinstance(batch, (tuple, torch.Size)) and all(isinstance(d, int) for d in batch):
        return (part(batch[0]), *batch[1:])
    return tree_map(
        lambda t: t.new_empty((part(t.shape[0]), *t.shape[1:])) if isinstance(t, torch.Tensor) else t, batch
    )


def _describe(batch: Any) -> str:
    if isinstance(batch, (tuple, torch.Size)) and all(isinstance(d, int) for d in batch):
        return f"token ids {tuple(batch)} int64"
    shapes = [f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tree_leaves(batch)]
    return ", ".join(shapes) if shapes else "no tensors"


def _trace_key(
    microbatch: Any,
    tensor_parallel: Mapping[str, ParallelStyle],
    checkpoint: Sequence[str],
    units: Sequence[str],
    compute_dtype: torch.dtype | None,
    autocast_dtype: torch.dtype | None,
) -> tuple[Any, ...]:
    """What a trace of one module depends on. A style is named by its type and settings (its layouts), which are
    all the trace reads of it; plans build new style objects for each layout."""
    styles = tuple(
        (fqn, type(style).__name__, repr(sorted(vars(style).items()))) for fqn, style in tensor_parallel.items()
    )
    return (_describe(microbatch), styles, tuple(checkpoint), tuple(units), compute_dtype, autocast_dtype)


def _merged(plans: ModulePlan | Sequence[ModulePlan]) -> ModulePlan:
    """One plan for the whole model from the pipeline ranks' local plans (each names only its stages' modules)."""
    if isinstance(plans, ModulePlan):
        return plans
    first, *rest = plans
    tensor_parallel = dict(first.tensor_parallel)
    checkpointed = list(first.activation_checkpointing)
    shard_units = list(first.shard_units)
    for plan in rest:
        tensor_parallel.update(plan.tensor_parallel)
        checkpointed += [fqn for fqn in plan.activation_checkpointing if fqn not in checkpointed]
        shard_units += [fqn for fqn in plan.shard_units if fqn not in shard_units]
    return ModulePlan(
        tensor_parallel,
        checkpointed,
        shard_units,
        activation_checkpointing_policy=first.activation_checkpointing_policy,
        adopted=first.adopted,
        pipeline=first.pipeline,
        context_parallel_loss=first.context_parallel_loss,  # CP has no pipeline: one plan, the dry run's list
        loss_parallel=first.loss_parallel,  # refused with pipelining: one plan, the dry run's list
    )


def _what_true_checkpoints(module: nn.Module, plan: ModulePlan, units: Sequence[str]) -> list[str]:
    """The modules `activation_checkpointing=True` would checkpoint: the FSDP units (a pipelined plan makes every
    pipeline unit one; of those, only the repeated blocks), or the repeated blocks."""
    blocks = set(repeated_blocks(module))
    shard_units = [fqn for fqn in plan.shard_units if fqn in blocks or fqn not in units]
    return resolve_activation_checkpointing(module, True, shard_units)


def estimate_activations(
    module: nn.Module,
    plan: ModulePlan | Sequence[ModulePlan],
    dims: ParallelDims,
    batch: Any,
    *,
    pipeline: PipelineConfig | None = None,
    compute_dtype: torch.dtype | None = None,
    autocast_dtype: torch.dtype | None = None,
    loss: Callable[[nn.Module, Any], torch.Tensor] = training_loss,
    traces: TraceCache | None = None,
) -> ActivationEstimate:
    """Activation memory per rank of `module` (unparallelised, on any device: meta is enough) under `plan` and `dims`.

    Args:
        plan: the module plan (`plan_modules`); under pipeline parallelism every pipeline rank's local plan, or one
            plan naming every stage's modules.
        batch: what one data-parallel rank's `training_step` receives per step: a shape (token ids) or a pytree of
            tensors (only shapes and dtypes are read). Under pipeline parallelism it is split into microbatches.
        pipeline: the strategy's pipeline settings (schedule, microbatches), when `dims.pipeline > 1`.
        compute_dtype: the dtype parameters compute in (bf16 under FSDP2's "bf16-mixed" policy).
        autocast_dtype: CPU autocast's dtype, for a wrapper that uses autocast (`replicate` under "bf16-mixed").
        loss: how to get the loss from the module and a batch (`module.training_step(batch, 0)` by default).
        traces: where to keep and reuse traces when estimating several layouts of the same `module` and `loss`.
    """
    whole = _merged(plan)
    split = whole.pipeline
    if (split is None) != (dims.pipeline == 1) or (split is not None and pipeline is None):
        raise ValueError("pipeline parallelism needs the plan's split and the strategy's `pipeline` settings")
    microbatches = pipeline.num_microbatches(dims.pipeline) if pipeline is not None else 1
    microbatch = microbatch_of(batch, microbatches)
    # Under loss parallel the output layer's logits stay sharded (`lightning_dpar.loss_parallel`): traced as split,
    # they and the log-probabilities the loss keeps count 1 / tensor_parallel on each rank.
    styles = sharded_output_styles(whole.tensor_parallel, whole.loss_parallel)
    tensor_parallel = styles if dims.tensor_parallel > 1 else {}
    units, stage_units = unit_indices(split.stages) if split is not None else ([], [None])
    checkpointed = whole.activation_checkpointing or _what_true_checkpoints(module, whole, units)

    def trace(checkpoint: Sequence[str], policy: CheckpointPolicyName = "full") -> StepTrace:
        key = (*_trace_key(microbatch, tensor_parallel, checkpoint, units, compute_dtype, autocast_dtype), dims.context)
        key = (*key, whole.context_parallel_loss, policy if checkpoint else None)
        if traces is not None and key in traces:
            return traces[key]
        traced = trace_step(
            module,
            microbatch,
            tensor_parallel=tensor_parallel,
            activation_checkpointing=checkpoint,
            checkpoint_policy=policy,
            units=units,
            compute_dtype=compute_dtype,
            autocast_dtype=autocast_dtype,
            loss=loss,
            context_parallel=dims.context,
            context_parallel_loss=whole.context_parallel_loss,
            loss_parallel=whole.loss_parallel is not None,
        )
        if traces is not None:
            traces[key] = traced
        return traced

    without = trace(())
    with_ = trace(checkpointed)
    selective = trace(checkpointed, "selective")
    notes = [f"tensor parallelism not traced for {name}: its activations count whole" for name in without.unmodelled]
    if whole.adopted:
        notes.append("the model parallelised itself in configure_model: activations are counted as unsplit")
    tp = dims.tensor_parallel
    stages = [
        StageActivations(
            index,
            footprint(without, indices, tp),
            footprint(with_, indices, tp),
            received=unit_input_bytes(without, indices[0], tp) if indices else 0,
            sent=unit_input_bytes(without, indices[-1] + 1, tp) if indices else 0,
            selective_checkpointing=footprint(selective, indices, tp),
        )
        for index, indices in enumerate(stage_units)
    ]
    ranks = []
    schedule, per_rank = (pipeline.schedule, pipeline.stages_per_rank) if pipeline is not None else (None, 1)
    for pipeline_rank in range(dims.pipeline):
        held = split.stages_of_rank(pipeline_rank) if split is not None else [0]
        in_flight, known = microbatches_in_flight(schedule, dims.pipeline, microbatches, per_rank, pipeline_rank)
        held_stages = tuple(stages[s] for s in held)
        ranks.append(RankActivations(pipeline_rank, held_stages, tuple(in_flight), known, microbatches))
    if pipeline is not None and not all(rank.in_flight_known for rank in ranks):
        notes.append(in_flight_not_modelled_note(pipeline.schedule.name))
    return ActivationEstimate(
        microbatch=_describe(microbatch),
        checkpointing=checkpointing_of(whole.activation_checkpointing, whole.activation_checkpointing_policy),
        checkpointed=tuple(checkpointed),
        tensor_parallel=dims.tensor_parallel,
        ranks=tuple(ranks),
        schedule=pipeline.schedule.name if pipeline is not None else None,
        microbatches=microbatches,
        notes=tuple(notes),
        flops=StepFlops(without.flops, with_.flops, selective.flops),
        loss_parallel=whole.loss_parallel if dims.tensor_parallel > 1 else None,
    )
