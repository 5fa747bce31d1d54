"""Every layout the search considers for a world size, and the ones refused on arithmetic alone, with the reason.

A `Layout` is the mesh sizes (`ParallelDims`, resolved by `ParallelDims.resolve`, the strategies' own validation),
the pipeline schedule, microbatches and stages per rank (when pipelining), and activation checkpointing (off, selective
or full).
`enumerate_layouts` walks, in a fixed order (so the same model and world always give the same list):

- pipeline sizes: every divisor of the world size (1 means no pipeline);
- tensor-parallel sizes: the divisors of the ranks per stage that fit in one node (TP wants the fastest links);
- replicate sizes (HSDP): 1, and on a single node every divisor of the data-parallel size; across nodes the ones
  whose shard groups are whole nodes (HSDP's reason to exist: shard within, replicate across);
- expert-parallel sizes, for an MoE model: every divisor of the shard dim;
- context-parallel sizes, when the sequence length is known: every divisor of the shard dim that `2 x` divides the
  sequence length (or one token more), without pipelining or expert parallelism (which CP does not compose with
  yet); CP ranks share one batch, so the batch rule is read at the data-parallel size over CP;
- the per-rank batch of each data-parallel size (a `BatchRule`: fixed per rank, or a global batch split over the
  data-parallel ranks); a size that gets no batch (a global batch that does not split evenly) is refused;
- with pipelining: `1F1B` and `GPipe` with 1 and 2 microbatches per stage, `Interleaved1F1B` with 2 stages per rank
  when the layers allow; the batch must divide by the microbatches and each schedule must accept them
  (`ScheduleSpec.check`); schedules without a closed-form bubble (LoopedBFS, zero-bubble) are not modelled;
- activation checkpointing off, selective and full (`CHECKPOINTING_SETTINGS`);
- with `loss_parallel=True` (the user's opt-in: a loss with label smoothing, or a step that reads the logits whole,
  fails under it, which no search can see), loss parallel on every layout with tensor parallelism and without
  pipeline or context parallelism (which refuse it); the others run without it. It is not a choice: with tensor
  parallelism it only saves memory and communication;
- with `float8=<recipe>`, every layout trains with float8 (its matmuls priced at the profile's float8 rate); the
  layouts the float8 step refuses (`lightning_dpar.float8.step.layout_refusal`: pipeline or context parallelism, the
  tensorwise recipe under tensor parallelism) are rejected, with its reason.

Each feature's offers and refusals are its own folder's rules (`lightning_dpar.pipeline.cost.pipeline_choices`,
`lightning_dpar.context_parallel.cost.context_sizes`, `lightning_dpar.experts.cost.expert_sizes`,
`lightning_dpar.loss_parallel.cost.runs_loss_parallel`, `lightning_dpar.float8.cost.layout_reason`); this module
walks them. What `ParallelDims.resolve` or a schedule refuses becomes a `Rejected` with its message; what only the
planner can say (heads not divisible by the TP size, too few layers for the stages) is found later, by the dry run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_dpar.activation_checkpointing.step import CHECKPOINTING_SETTINGS, Checkpointing
from lightning_dpar.context_parallel.cost import context_sizes
from lightning_dpar.experts.cost import expert_sizes
from lightning_dpar.float8.cost import layout_reason
from lightning_dpar.helpers import divisors
from lightning_dpar.layout_search.batch import BatchRule
from lightning_dpar.loss_parallel.cost import runs_loss_parallel
from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.pipeline.cost import MODELLED_SCHEDULES, PipelineChoice, PipelineRefusal, pipeline_choices

__all__ = ["Layout", "Rejected", "checkpointing_name", "enumerate_layouts"]


def checkpointing_name(checkpointing: Checkpointing) -> str:
    """`off`, `selective` or `on` (full), as the search's table names a layout's activation checkpointing."""
    return "selective" if checkpointing == "selective" else ("on" if checkpointing else "off")


@dataclass(frozen=True)
class Layout:
    """One way to lay the model out on the world."""

    dims: ParallelDims
    activation_checkpointing: Checkpointing = False
    schedule: str | None = None  # None without pipelining
    microbatches: int = 1
    stages_per_rank: int = 1
    #: Whether the output layer's logits stay sharded over the vocabulary (`loss_parallel=True`).
    loss_parallel: bool = False
    #: torchao's float8 recipe the layout trains with, or None.
    float8: str | None = None

    @property
    def mesh_key(self) -> tuple[int, int, int, int, int, int, int]:
        """What the dry run's numbers depend on: the mesh sizes and the stages per rank."""
        d = self.dims
        return (d.pipeline, d.replicate, d.shard, d.tensor_parallel, d.expert, self.stages_per_rank, d.context)

    @property
    def probe_key(self) -> tuple[Any, ...]:
        """What the dry run's numbers depend on, activations included: the mesh, the schedule and microbatches (the
        dry run traces with and without activation checkpointing at once), and loss parallel (the plan and the trace
        of the logits)."""
        return (*self.mesh_key, self.schedule, self.microbatches, self.loss_parallel)

    @property
    def sort_key(self) -> tuple[Any, ...]:
        """A total order, for deterministic ties: the simplest layout first."""
        order = MODELLED_SCHEDULES.index(self.schedule) if self.schedule else -1
        return (*self.mesh_key, order, self.microbatches, CHECKPOINTING_SETTINGS.index(self.activation_checkpointing))

    def mesh(self) -> str:
        d = self.dims
        parts = [f"pp{d.pipeline}"] if d.pipeline > 1 else []
        parts += [f"rep{d.replicate}"] if d.replicate > 1 else []
        parts += [f"fsdp{d.shard}", f"tp{d.tensor_parallel}"]
        parts += [f"ep{d.expert}"] if d.expert > 1 else []
        parts += [f"cp{d.context}"] if d.context > 1 else []
        return " ".join(parts)

    def pipeline(self) -> str:
        if self.schedule is None:
            return "-"
        interleave = f" v{self.stages_per_rank}" if self.stages_per_rank > 1 else ""
        return f"{self.schedule}{interleave} m{self.microbatches}"

    def describe(self) -> str:
        ac = f"AC {checkpointing_name(self.activation_checkpointing)}"
        pipeline = f", {self.pipeline()}" if self.schedule else ""
        loss = ", loss parallel" if self.loss_parallel else ""
        float8 = f", float8 {self.float8}" if self.float8 else ""
        return f"{self.mesh()}{pipeline}, {ac}{loss}{float8}"

    def strategy_kwargs(self) -> dict[str, Any]:
        """The `FSDPTensorParallelStrategy` arguments that train this layout by hand."""
        d = self.dims
        kwargs: dict[str, Any] = {
            "tensor_parallel_size": d.tensor_parallel,
            "replicate_size": d.replicate,
            "activation_checkpointing": self.activation_checkpointing,
        }
        if self.loss_parallel:
            kwargs["loss_parallel"] = True
        if self.float8 is not None:
            kwargs["float8"] = self.float8
        if d.expert > 1:
            kwargs["expert_parallel_size"] = d.expert
        if d.context > 1:
            kwargs["context_parallel_size"] = d.context
        if d.pipeline > 1:
            kwargs.update(
                pipeline_parallel_size=d.pipeline,
                pipeline_schedule=self.schedule,
                pipeline_microbatches=self.microbatches,
                pipeline_stages_per_rank=self.stages_per_rank,
            )
        return kwargs


@dataclass(frozen=True)
class Rejected:
    """A layout that cannot run (or that the cost model cannot price), and why."""

    what: str
    reason: str


def _replicate_sizes(dp: int, tp: int, devices_per_node: int, num_nodes: int) -> list[int]:
    if num_nodes == 1:
        return divisors(dp)
    return [r for r in divisors(dp) if r == 1 or (dp // r * tp) % devices_per_node == 0]


def enumerate_layouts(
    world_size: int,
    devices_per_node: int,
    num_nodes: int,
    layers: int,
    batch_size: int | BatchRule,
    moe: bool = False,
    seq_len: int | None = None,
    loss_parallel: bool = False,
    float8: str | None = None,
) -> tuple[list[Layout], list[Rejected]]:
    """Every layout considered on `world_size` ranks (see the module docstring), and those refused up front.
    `batch_size`: samples per data-parallel rank, or the rule giving them for each data-parallel size; `seq_len`:
    the tokens per sequence, without which no context-parallel layout is considered; `loss_parallel`: loss parallel
    where it can run (tensor parallelism, no pipeline or context parallelism); `float8`: the recipe every layout
    trains with."""
    rule = batch_size if isinstance(batch_size, BatchRule) else BatchRule(per_rank=batch_size)
    layouts: list[Layout] = []
    rejected: list[Rejected] = []

    def refuse(refusal: Rejected) -> None:
        if refusal not in rejected:  # the same pipeline refusal comes back for each TP size of a batch
            rejected.append(refusal)

    for pp in divisors(world_size):
        stage_ranks = world_size // pp
        for tp in divisors(stage_ranks):
            if tp > devices_per_node:
                refuse(Rejected(f"tp{tp}", f"spans nodes (a node has {devices_per_node} devices)"))
                continue
            dp = stage_ranks // tp
            batch = rule.at(dp)
            if isinstance(batch, str):
                refuse(Rejected(f"pp{pp} tp{tp} ({dp} data-parallel ranks)", batch))
                continue
            choices = list(pipeline_choices(pp, layers, batch)) if pp > 1 else [PipelineChoice(None, 1, 1)]
            for refusal in (p for p in choices if isinstance(p, PipelineRefusal)):
                refuse(Rejected(*refusal))
            pipelines = [p for p in choices if isinstance(p, PipelineChoice)]
            for replicate in _replicate_sizes(dp, tp, devices_per_node, num_nodes):
                for ep in expert_sizes(dp // replicate, moe):
                    for cp in context_sizes(dp // replicate, seq_len, ep):
                        if cp > 1 and isinstance(rule.at(dp // cp), str):
                            refuse(Rejected(f"tp{tp} cp{cp} ({dp // cp} data-parallel ranks)", str(rule.at(dp // cp))))
                            continue
                        try:
                            dims = ParallelDims.resolve(
                                world_size,
                                devices_per_node,
                                tensor_parallel_size=tp,
                                replicate_size=replicate,
                                num_nodes=num_nodes,
                                pipeline_parallel_size=pp,
                                expert_parallel_size=ep,
                                context_parallel_size=cp,
                            )
                        except ValueError as err:
                            what = f"pp{pp} rep{replicate} tp{tp} ep{ep}" + (f" cp{cp}" if cp > 1 else "")
                            refuse(Rejected(what, str(err)))
                            continue
                        reason = layout_reason(float8, dims)
                        if reason is not None:
                            refuse(Rejected(f"pp{pp} tp{tp}" + (f" cp{cp}" if cp > 1 else ""), reason))
                            continue
                        sharded_logits = runs_loss_parallel(loss_parallel, dims)
                        for schedule, microbatches, stages_per_rank in pipelines:
                            for ac in CHECKPOINTING_SETTINGS:
                                layouts.append(
                                    Layout(dims, ac, schedule, microbatches, stages_per_rank, sharded_logits, float8)
                                )
    return sorted(layouts, key=lambda layout: layout.sort_key), rejected
