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

What `ParallelDims.resolve` or a schedule refuses becomes a `Rejected` with its message; what only the planner can
say (heads not divisible by the TP size, too few layers for the stages) is found later, by the dry run.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from lightning_dpar.activation_checkpointing.step import CHECKPOINTING_SETTINGS, Checkpointing
from lightning_dpar.float8.step import layout_refusal
from lightning_dpar.helpers import divisors
from lightning_dpar.layout_search.batch import BatchRule
from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.pipeline.schedule import schedule_spec

__all__ = ["MODELLED_SCHEDULES", "Layout", "Rejected", "checkpointing_name", "enumerate_layouts"]

#: The schedules the cost model can price (a closed-form bubble in `ScheduleSpec.bubble`), in preference order.
MODELLED_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")


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


def _context_sizes(shard: int, seq_len: int | None) -> list[int]:
    """1, and the context-parallel sizes a sequence of `seq_len` tokens can be split over (head-tail: 2 x CP chunks).
    The blocks see `seq_len` tokens of a model that cuts one off its batch (the example GPT) and `seq_len + 1` of one
    that does not (a transformers model given `labels`): either may divide; the dry run's trace, which runs the
    model's own step, refuses the layout if the blocks' length does not."""
    if seq_len is None:
        return [1]
    return [c for c in divisors(shard) if c == 1 or seq_len % (2 * c) == 0 or (seq_len + 1) % (2 * c) == 0]


def _pipelines(pp: int, layers: int, batch_size: int) -> Iterator[tuple[str, int, int] | Rejected]:
    """(schedule, microbatches, stages per rank) for `pp` pipeline ranks, or why one is refused."""
    for name in MODELLED_SCHEDULES:
        spec = schedule_spec(name)
        stages_per_rank = 2 if spec.multi_stage else 1
        what = f"pp{pp} {name}"
        if pp * stages_per_rank > layers:
            yield Rejected(what, f"{pp * stages_per_rank} stages need at least as many layers; the model has {layers}")
            continue
        for microbatches in (pp, 2 * pp):
            if batch_size % microbatches:
                yield Rejected(
                    f"{what} m{microbatches}",
                    f"the per-rank batch size {batch_size} does not divide into {microbatches} microbatches",
                )
                continue
            try:
                spec.check(microbatches, stages_per_rank, pp)
            except ValueError as err:
                yield Rejected(f"{what} m{microbatches}", str(err))
                continue
            yield name, microbatches, stages_per_rank


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
            pipelines = list(_pipelines(pp, layers, batch)) if pp > 1 else [(None, 1, 1)]
            for refusal in (p for p in pipelines if isinstance(p, Rejected)):
                refuse(refusal)
            pipelines = [p for p in pipelines if not isinstance(p, Rejected)]
            for replicate in _replicate_sizes(dp, tp, devices_per_node, num_nodes):
                for ep in divisors(dp // replicate) if moe else [1]:
                    # CP does not compose with EP yet (both borrow the shard dim's ranks); it does with PP.
                    for cp in [1] if ep > 1 else _context_sizes(dp // replicate, seq_len):
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
                        float8_refusal = None if float8 is None else layout_refusal(float8 == "tensorwise", dims)
                        if float8_refusal is not None:
                            what = f"pp{pp} tp{tp}" + (f" cp{cp}" if cp > 1 else "")
                            refuse(Rejected(what, f"float8 {float8_refusal}"))
                            continue
                        sharded_logits = loss_parallel and tp > 1 and pp == 1 and cp == 1
                        for schedule, microbatches, stages_per_rank in pipelines:  # type: ignore[misc]
                            for ac in CHECKPOINTING_SETTINGS:
                                layouts.append(
                                    Layout(dims, ac, schedule, microbatches, stages_per_rank, sharded_logits, float8)
                                )
    return sorted(layouts, key=lambda layout: layout.sort_key), rejected
