"""Pipeline parallelism as the layout search prices it (`lightning_dpar.layout_search`): the schedules it offers a
pipeline of a given size, and why it refuses the others; each pipeline rank's share of the layers; the bubble; the
activations and gradients sent across stage boundaries; and how often FSDP gathers the parameters under pipelining.

Pure functions of numbers and of a layout read through `PipelinedLayout` (its mesh sizes, schedule, microbatches and
stages per rank): the search's own `Layout` is one, and so is any object with those attributes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple, Protocol

from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.pipeline.estimate import stage_share
from lightning_dpar.pipeline.schedule import schedule_spec

__all__ = [
    "MODELLED_SCHEDULES",
    "PipelineChoice",
    "PipelineRefusal",
    "PipelinedLayout",
    "bubble_seconds",
    "parameter_gathers",
    "per_rank",
    "pipeline_choices",
    "stage_boundary_seconds",
]

#: The schedules the cost model can price (a closed-form bubble in `ScheduleSpec.bubble`), in preference order.
MODELLED_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")


class PipelinedLayout(Protocol):
    """What the pricing reads of a layout: its mesh sizes, and its schedule (`None` without pipelining),
    microbatches and stages per rank."""

    @property
    def dims(self) -> ParallelDims: ...

    @property
    def schedule(self) -> str | None: ...

    @property
    def microbatches(self) -> int: ...

    @property
    def stages_per_rank(self) -> int: ...


class Link(Protocol):
    """A link between two ranks (`lightning_dpar.layout_search.profiles.Link`): seconds to move n bytes."""

    def seconds(self, nbytes: float, steps: int = 1) -> float: ...


class PipelineChoice(NamedTuple):
    """One way to pipeline: the schedule (`None`: no pipeline), the microbatches per step and the stages each rank
    holds."""

    schedule: str | None
    microbatches: int
    stages_per_rank: int


class PipelineRefusal(NamedTuple):
    """A pipeline the search does not consider (`what`: its name in the search's table), and why."""

    what: str
    reason: str


def pipeline_choices(pp: int, layers: int, batch_size: int) -> Iterator[PipelineChoice | PipelineRefusal]:
    """Every pipeline of `pp` ranks the search considers for a model of `layers` layers and a per-rank batch of
    `batch_size` samples, or why one is refused: each modelled schedule (`MODELLED_SCHEDULES`; two stages per rank
    for a multi-stage one), with `pp` and `2 x pp` microbatches. Refused: more stages than layers, a batch that does
    not divide into the microbatches, and what the schedule itself refuses (`ScheduleSpec.check`)."""
    for name in MODELLED_SCHEDULES:
        spec = schedule_spec(name)
        stages_per_rank = 2 if spec.multi_stage else 1
        what = f"pp{pp} {name}"
        if pp * stages_per_rank > layers:
            yield PipelineRefusal(
                what, f"{pp * stages_per_rank} stages need at least as many layers; the model has {layers}"
            )
            continue
        for microbatches in (pp, 2 * pp):
            if batch_size % microbatches:
                yield PipelineRefusal(
                    f"{what} m{microbatches}",
                    f"the per-rank batch size {batch_size} does not divide into {microbatches} microbatches",
                )
                continue
            try:
                spec.check(microbatches, stages_per_rank, pp)
            except ValueError as err:
                yield PipelineRefusal(f"{what} m{microbatches}", str(err))
                continue
            yield PipelineChoice(name, microbatches, stages_per_rank)


def per_rank(count: int, dims: ParallelDims) -> int:
    """The share of `count` layers (or MoE layers) the busiest pipeline rank holds: `count` split over the pipeline
    ranks, rounded up (all of them without pipelining)."""
    return stage_share(count, dims.pipeline, 1)


def parameter_gathers(layout: PipelinedLayout) -> int:
    """How many times per step FSDP all-gathers each unit's parameters: once in forward and once in backward, for
    each microbatch under pipelining (each microbatch runs its own forward and backward of the stage)."""
    return 2 * (layout.microbatches if layout.dims.pipeline > 1 else 1)


def bubble_seconds(compute: float, layout: PipelinedLayout) -> float:
    """The pipeline bubble of a step of `compute` seconds: `compute x bubble / (1 - bubble)`, the bubble fraction
    from the schedule's closed form (`ScheduleSpec.bubble`); 0 without pipelining."""
    if layout.schedule is None:
        return 0.0
    fraction = schedule_spec(layout.schedule).bubble(layout.dims.pipeline, layout.microbatches, layout.stages_per_rank)
    assert fraction is not None, f"{layout.schedule} has no closed-form bubble; candidates exclude it"
    return compute * fraction / (1 - fraction)


def stage_boundary_seconds(layout: PipelinedLayout, activation: int, link: Link) -> float:
    """The stage boundaries' sends of one step over `link`: one activation forward and one gradient backward per
    microbatch and stage, each `activation` bytes (one microbatch's hidden states; under context parallelism, this
    rank's part of the sequence); 0 without pipelining."""
    d = layout.dims
    if d.pipeline == 1:
        return 0.0
    return 2 * layout.microbatches * layout.stages_per_rank * link.seconds(activation // d.context)
