"""The cost model: one layout's per-rank peak memory and step time, from the model's facts, the dry run's numbers and
a hardware profile. Pure functions of data. Each feature's terms are its own folder's arithmetic, which this module
adds up: `lightning_dpar.pipeline.cost` (the bubble, the stage boundaries, each rank's layers),
`lightning_dpar.context_parallel.cost`, `lightning_dpar.experts.cost`, `lightning_dpar.loss_parallel.cost`,
`lightning_dpar.activation_checkpointing.cost` (recomputation) and `lightning_dpar.float8.cost` (the float8 rate).

Step time (seconds, one optimizer step of every data-parallel rank's batch) is split into:

- compute: `flops_per_token x tokens per data-parallel rank / (tp x pp x cp) / matmul_flops` (6 x active parameters
  per token, 8 x with full activation checkpointing, and with selective checkpointing 6 + 2 x the share of full's
  recomputation the dry run's trace measured it recomputing, `MeshMemory.selective_share`;
  `ModelFacts.flops_per_token`; the head's work that every CP rank repeats on the whole sequence is not counted).
  Under float8 (`Layout.float8`), the FLOPs of the `nn.Linear` layers float8 converts (`ModelFacts.float8_params`,
  `ModelFacts.float8_flops_per_token`) run at the profile's `float8_matmul_flops` and the rest (attention, the
  output layer, unconverted layers) at `matmul_flops`: a model of the matmuls alone, which leaves out the casts and
  scales float8 adds (torchao measures +25% tensorwise, +10% rowwise end-to-end on H100, against the up to 2x the
  matmul rates give here);
- pipeline bubble: `compute x bubble / (1 - bubble)`, the bubble fraction from `ScheduleSpec.bubble`;
- exposed communication: each collective's bytes per rank over the link its group crosses (`Link.seconds`, the
  latency paid per ring step; `HardwareProfile.collective_link` uses measured numbers when the profile has them):
  - FSDP: all-gather of each stage's parameters (compute dtype, TP and expert shards kept) in forward and again in
    backward (`reshard_after_forward=True`), per microbatch with pipelining; reduce-scatter of the gradients
    (parameter dtype) once per step; HSDP adds an all-reduce of the shard over the replicas. The profile's
    `fsdp_overlap` of it hides behind compute (never more than the compute time);
  - TP: 4 all-reduces of one microbatch's activations per layer (2 forward, 2 backward; 6 with checkpointing, full or
    selective: the selective policy keeps reduce-scatters' outputs, not all-reduces'), on the critical path; and
    the output layer's: its logits all-gathered whole on every TP rank once per microbatch when the plan gathers its
    column-wise output (`MeshMemory.gathered_output`, its output features; the backward only slices), or, under loss
    parallel, torch's three all-reduces of one float per token instead (the row maximum, the sum of exponentials,
    the target's logit);
  - PP: one activation forward and one gradient backward per microbatch and stage boundary (under CP this rank's
    part of the sequence);
  - EP: 4 all-to-alls per MoE layer and microbatch (dispatch and combine, forward and backward; 6 with
    checkpointing) of each token's `k` chosen hidden states;
  - CP: per layer (of the pipeline rank's stages), the all-gather of the sequence's keys and values in forward and
    the reduce-scatter of their gradients in backward (`lightning_dpar.context_parallel.exchange`; the key/value
    width is taken as the hidden size, an upper bound under grouped-query attention), and once per step the hidden
    states gathered after the last block and their gradient gathered before the first, on the critical path.
  Ring collectives move `(n - 1) / n` of the buffer per rank (all-gather, reduce-scatter, all-to-all) and twice that
  for all-reduce. A group crosses nodes when its ranks span more than one node (ranks are laid out row-major as
  pipeline, replicate, shard, tensor parallel; see `parallel_dims.ParallelMeshes`).

Per-rank peak memory, on the pipeline rank whose peak is highest, is split into parameters, gradients and optimizer
state (the dry run's), activations (the dry run's traced estimate, `lightning_dpar.estimates.activations`: one training
step run on fake tensors with the layout's tensor-parallel styles, pipeline stages, schedule and checkpointing; the
formula of `layout.activations` only when the step cannot be traced) and communication buffers: the FSDP unit being
computed and the one prefetched, all-gathered (2 x the dry run's largest unit), plus a reduce-scatter buffer of one
unit's gradients; and the profile's `runtime_memory`. The step time adds the profile's `step_overhead`. Under loss
parallel (`Layout.loss_parallel`) the logits, the log-probabilities the loss keeps and their gradients are this
rank's vocabulary shard: the dry run's trace runs the output layer sharded (the `plan` dry run's estimate), and the
formula divides its logits term by the tensor-parallel size. float8 is priced with the memory of the unconverted
model (the dry run plans without it): torchao's `Float8Linear` keeps the weights in their precision."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from lightning_dpar.activation_checkpointing.cost import collective_passes
from lightning_dpar.activation_checkpointing.estimate import figure_of
from lightning_dpar.activation_checkpointing.step import Checkpointing
from lightning_dpar.context_parallel.cost import exchange_seconds
from lightning_dpar.estimates.activation_formula import activation_bytes
from lightning_dpar.experts.cost import all_to_all_seconds, sharded_parameters
from lightning_dpar.float8.cost import compute_seconds
from lightning_dpar.layout_search.candidates import Layout
from lightning_dpar.layout_search.model_facts import ModelFacts
from lightning_dpar.layout_search.profiles import HardwareProfile, check_float8
from lightning_dpar.loss_parallel.cost import output_layer_seconds
from lightning_dpar.pipeline.cost import bubble_seconds, parameter_gathers, per_rank, stage_boundary_seconds

__all__ = ["Estimate", "MemorySplit", "MeshMemory", "RankMemory", "TimeSplit", "estimate"]


@dataclass(frozen=True)
class RankMemory:
    """The dry run's bytes on one pipeline rank (on every rank, without pipelining): what lives for the whole run,
    and the activation peak of a step without, with full and with selective activation checkpointing (`None`: the
    training step could not be traced on fake tensors, and the formula of `layout.activations` stands in; for
    selective checkpointing, its figure without checkpointing, an upper bound)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int | None = None
    activations_checkpointed: int | None = None
    activations_selective: int | None = None

    def activation_peak(self, checkpointing: Checkpointing) -> int | None:
        if checkpointing == "selective" and self.activations_selective is None:
            return None  # not traced: `layout.activations`' formula stands in
        return figure_of(checkpointing, self.activations, self.activations_checkpointed, self.activations_selective)


@dataclass(frozen=True)
class MeshMemory:
    """The dry run's numbers for one layout (but its activation checkpointing): each pipeline rank's memory, and the
    largest FSDP unit all-gathered for compute."""

    ranks: tuple[RankMemory, ...]
    gathered_unit: int
    #: The share of full checkpointing's recomputed FLOPs that selective checkpointing recomputes, measured on the
    #: dry run's traced step (`StepFlops`); `None`: not traced.
    selective_share: float | None = None
    #: The output features of the column-wise layers whose output the plan gathers whole on every tensor-parallel
    #: rank (the output layer's vocabulary, in a language model; 0 when none, or without tensor parallelism).
    gathered_output: int = 0


@dataclass(frozen=True)
class MemorySplit:
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    buffers: int
    runtime: int = 0  # the profile's `runtime_memory`
    activations_traced: bool = True  # False: the formula of `layout.activations` stood in

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.buffers + self.runtime


@dataclass(frozen=True)
class TimeSplit:
    compute: float
    exposed_communication: float
    bubble: float
    communication: float  # all of it, hidden or not
    overhead: float = 0.0  # the profile's `step_overhead`

    @property
    def total(self) -> float:
        return self.compute + self.exposed_communication + self.bubble + self.overhead


@dataclass(frozen=True)
class Estimate:
    """One layout's predicted per-rank peak memory and step time; `samples_per_step` is the global batch."""

    layout: Layout
    memory: MemorySplit
    time: TimeSplit
    samples_per_step: int

    @property
    def seconds_per_sample(self) -> float:
        """What the search ranks by: step time over the global batch (layouts with fewer data-parallel ranks train
        fewer samples per step, the loaders' batch size being per rank)."""
        return self.time.total / self.samples_per_step


def _crosses(span: int, profile: HardwareProfile) -> bool:
    return span > profile.devices_per_node


def _ring(
    profile: HardwareProfile, collective: str, n: int, nbytes: float, span: int, all_reduce: bool = False
) -> float:
    """Seconds for one ring collective over `n` ranks of an `nbytes` buffer (the whole, unsharded size)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    link = profile.collective_link(collective, n, _crosses(span, profile))
    factor = 2 if all_reduce else 1
    return link.seconds(factor * nbytes * (n - 1) / n, steps=factor * (n - 1))


def _fsdp_seconds(layout: Layout, facts: ModelFacts, profile: HardwareProfile) -> float:
    d = layout.dims
    units = per_rank(facts.layers, d) + 1
    gathers = parameter_gathers(layout)
    seconds = 0.0
    span = d.shard * d.tensor_parallel
    for params, n in sharded_parameters(facts.params, facts.expert_params, d):
        if params <= 0:
            continue
        per_unit = params / units
        seconds += units * gathers * _ring(profile, "all_gather", n, per_unit * facts.activation_bytes, span)
        seconds += units * _ring(profile, "reduce_scatter", n, per_unit * facts.param_bytes, span)
        if d.replicate > 1:
            shard_bytes = per_unit * facts.param_bytes / n
            seconds += units * _ring(profile, "all_reduce", d.replicate, shard_bytes, span * d.replicate, True)
    return seconds


def _critical_seconds(
    layout: Layout, facts: ModelFacts, mesh: MeshMemory, profile: HardwareProfile
) -> tuple[float, float, float]:
    """TP all-reduces (and the output layer's gather or loss parallel's all-reduces), PP sends and EP all-to-alls per
    step: none of them overlaps compute here."""
    d = layout.dims
    ring = partial(_ring, profile)
    microbatch = facts.batch_size // layout.microbatches
    activation = microbatch * facts.seq_len * facts.hidden * facts.activation_bytes
    layers = per_rank(facts.layers, d)
    passes = collective_passes(layout.activation_checkpointing)
    tp = layers * layout.microbatches * passes
    tp *= ring("all_reduce", d.tensor_parallel, activation, d.tensor_parallel, True)
    tokens = microbatch * facts.seq_len
    tp += output_layer_seconds(
        layout.loss_parallel,
        d.tensor_parallel,
        layout.microbatches,
        tokens,
        mesh.gathered_output,
        facts.activation_bytes,
        ring,
    )
    link = profile.collective_link("send_recv", 2, _crosses(d.world_size, profile))
    pp = stage_boundary_seconds(layout, activation, link)
    moe_layers = per_rank(facts.moe_layers, d)
    ep = all_to_all_seconds(
        d, facts.experts, facts.experts_per_token, moe_layers, layout.microbatches, passes, activation, ring
    )
    return tp, pp, ep


def _context_seconds(layout: Layout, facts: ModelFacts, profile: HardwareProfile) -> float:
    """The context-parallel exchanges of one step (see the module docstring); 0 without CP: each pipeline rank
    exchanges for its own stages' layers."""
    sequence = facts.batch_size * facts.seq_len * facts.hidden * facts.activation_bytes
    return exchange_seconds(layout.dims, per_rank(facts.layers, layout.dims), sequence, partial(_ring, profile))


def _formula_activations(layout: Layout, facts: ModelFacts) -> int:
    """Peak activation bytes of the first pipeline rank by the formula of `layout.activations`."""
    d = layout.dims
    return activation_bytes(
        layers=facts.layers,
        hidden=facts.hidden,
        heads=facts.heads,
        vocab=facts.vocab,
        seq_len=facts.seq_len // d.context,  # the blocks' share, which dominates
        microbatch_size=facts.batch_size // layout.microbatches,
        element_size=facts.activation_bytes,
        tensor_parallel=d.tensor_parallel,
        pipeline=d.pipeline,
        microbatches=layout.microbatches,
        schedule=layout.schedule,
        stages_per_rank=layout.stages_per_rank,
        # not traced: selective checkpointing's activations counted as without checkpointing (an upper bound)
        checkpointing=layout.activation_checkpointing is True,
        loss_parallel=layout.loss_parallel,
    )


def _peak_rank(layout: Layout, facts: ModelFacts, mesh: MeshMemory) -> tuple[RankMemory, int | None]:
    """The pipeline rank with the highest peak under `layout`, and its activation bytes: the traced peak of each
    rank; without a trace, the rank holding the most parameters and `None` (the formula's first-stage peak goes on
    it, an upper bound: the two need not be the same rank)."""
    checkpointing = layout.activation_checkpointing
    if all(rank.activation_peak(checkpointing) is not None for rank in mesh.ranks):

        def total(rank: RankMemory) -> int:
            return rank.parameters + rank.gradients + rank.optimizer + (rank.activation_peak(checkpointing) or 0)

        rank = max(mesh.ranks, key=total)
        return rank, rank.activation_peak(checkpointing)
    return max(mesh.ranks, key=lambda r: r.parameters + r.gradients + r.optimizer), None


def _compute_seconds(layout: Layout, facts: ModelFacts, mesh: MeshMemory, profile: HardwareProfile) -> float:
    """One step's compute on one rank: its share of the FLOPs at the profile's rates (float8 ones at its float8 rate
    under float8; see the module docstring)."""
    d = layout.dims
    share = d.tensor_parallel * d.pipeline * d.context
    checkpointing = layout.activation_checkpointing
    flops = facts.flops_per_token(checkpointing, mesh.selective_share) * facts.tokens_per_rank / share
    converted = facts.float8_flops_per_token(checkpointing, mesh.selective_share) * (facts.tokens_per_rank / share)
    check_float8(layout.float8, profile)
    return compute_seconds(layout.float8, flops, converted, profile)


def estimate(layout: Layout, facts: ModelFacts, mesh: MeshMemory, profile: HardwareProfile) -> Estimate:
    """The predicted per-rank peak memory and step time of `layout` (see the module docstring)."""
    d = layout.dims
    compute = _compute_seconds(layout, facts, mesh, profile)
    bubble = bubble_seconds(compute, layout)
    fsdp = _fsdp_seconds(layout, facts, profile)
    tp, pp, ep = _critical_seconds(layout, facts, mesh, profile)
    cp = _context_seconds(layout, facts, profile)
    exposed = fsdp - min(fsdp * profile.fsdp_overlap, compute) + tp + pp + ep + cp
    rank, traced = _peak_rank(layout, facts, mesh)
    reduce_buffer = mesh.gathered_unit * facts.param_bytes // max(facts.activation_bytes, 1)
    memory = MemorySplit(
        parameters=rank.parameters,
        gradients=rank.gradients,
        optimizer=rank.optimizer,
        activations=traced if traced is not None else _formula_activations(layout, facts),
        buffers=2 * mesh.gathered_unit + reduce_buffer,
        runtime=profile.runtime_memory,
        activations_traced=traced is not None,
    )
    time = TimeSplit(compute, exposed, bubble, fsdp + tp + pp + ep + cp, profile.step_overhead)
    return Estimate(layout, memory, time, facts.batch_size * d.data_parallel)
