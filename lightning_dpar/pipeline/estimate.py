"""What pipeline parallelism does to a rank's memory, as arithmetic on numbers, for `lightning_dpar.estimates` (the
`plan` dry run, and the activation formula a layout search falls back on): which ranks hold a pipeline rank's
stages, a stage's share of the model's layers, how many microbatches a rank keeps in flight on each of its stages
(`ScheduleSpec.microbatches_in_flight`), the receive buffers torch's `PipelineStage` keeps, and how its stages'
figures add up to a rank's activation peak; and the dry-run report's lines on them (its pipeline section is
`lightning_dpar.pipeline.report`).

Pure: the estimates pass numbers, names and the schedule's `ScheduleSpec` in (a stage's activation figures through
`Kept`), so this module needs nothing above the pipeline folder.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from lightning_dpar.pipeline.schedule import ScheduleSpec

__all__ = [
    "Kept",
    "describe_in_flight",
    "in_flight_not_modelled_note",
    "microbatches_in_flight",
    "outputs_in_flight",
    "peer_rank",
    "pipeline_rank_of",
    "rank_activation_peak",
    "receive_buffer_bytes",
    "stage_ranks",
    "stage_share",
    "unit_indices",
    "unsharded_units_note",
]


class Kept(Protocol):
    """One stage's activations of one microbatch: kept from its forward for its backward, and at most."""

    @property
    def retained(self) -> int: ...

    @property
    def peak(self) -> int: ...


def pipeline_rank_of(rank: int, world_size: int, num_ranks: int) -> int:
    """The pipeline rank of global rank `rank` (meshes are row-major with the pipeline dim outermost)."""
    return rank // (world_size // num_ranks)


def stage_ranks(pipeline_rank: int, world_size: int, num_ranks: int) -> range:
    """The global ranks holding `pipeline_rank`'s stages (one pipeline rank's group)."""
    per_rank = world_size // num_ranks
    return range(pipeline_rank * per_rank, (pipeline_rank + 1) * per_rank)


def peer_rank(rank: int, pipeline_rank: int, world_size: int, num_ranks: int) -> int:
    """The global rank of `pipeline_rank` at `rank`'s coordinate in the other mesh dims: it holds the same local
    shapes of its own stages as `rank`'s pipeline peers do."""
    return stage_ranks(pipeline_rank, world_size, num_ranks)[rank % (world_size // num_ranks)]


def stage_share(layers: int, num_ranks: int, stages_per_rank: int) -> int:
    """The layers of the largest stage when `layers` equal layers split over `num_ranks * stages_per_rank` stages."""
    return -(-layers // (num_ranks * stages_per_rank))


def unit_indices(stages: Sequence[Sequence[str]]) -> tuple[list[str], list[list[int]]]:
    """The stages' units in call order, and each stage's indices into them."""
    units = [unit for stage in stages for unit in stage]
    starts = [0]
    for stage in stages:
        starts.append(starts[-1] + len(stage))
    return units, [list(range(starts[s], starts[s + 1])) for s in range(len(stages))]


def microbatches_in_flight(
    schedule: ScheduleSpec | None, num_ranks: int, microbatches: int, stages_per_rank: int, pipeline_rank: int
) -> tuple[tuple[int, ...], bool]:
    """The most microbatches `pipeline_rank` keeps in flight on each of its stages, and whether the schedule's count
    is modelled: one without pipelining (`schedule=None`); for a schedule whose count is not modelled, every
    microbatch on each stage (an upper bound)."""
    if schedule is None:
        return (1,), True
    counts = schedule.microbatches_in_flight(num_ranks, microbatches, stages_per_rank, pipeline_rank)
    if counts is None:
        return (microbatches,) * stages_per_rank, False
    return counts, True


def outputs_in_flight(schedule: str | None, microbatches: int) -> int:
    """The microbatches whose model output (the logits and what the loss keeps of them) are alive at once on the
    last stage: every one under GPipe (all forwards run before the first backward), else one."""
    return microbatches if schedule == "GPipe" else 1


def receive_buffer_bytes(microbatches: int, boundaries: Sequence[tuple[int, int]]) -> int:
    """What torch's `PipelineStage` allocates once for every microbatch and keeps, over a rank's stages: for each
    stage (`(received, sent)` bytes of one microbatch's activation at its boundaries) a buffer for the activation
    from the stage before (the input its backward needs) and one for the gradient from the stage after."""
    return sum(microbatches * (received + sent) for received, sent in boundaries)


def rank_activation_peak(in_flight: Sequence[int], stages: Sequence[Kept], receive_buffers: int) -> int:
    """A rank's activation peak over a step: each stage keeps its retained bytes for every microbatch in flight on
    it, the receive buffers stay, and one stage's backward working set (peak above retained) comes on top, since
    a rank computes one stage at a time."""
    total, work = receive_buffers, 0
    for count, stage in zip(in_flight, stages):
        total += count * stage.retained
        work = max(work, stage.peak - stage.retained)
    return total + work


def describe_in_flight(
    schedule: str, microbatches: int, in_flight: Sequence[int], known: bool, buffers: str, peak: str
) -> str:
    """The report's line on what a rank keeps over a step: the microbatches in flight on each of its stages, the
    receive buffers (`buffers`, formatted) and the resulting peak (`peak`, formatted)."""
    per_stage = ", ".join(str(n) for n in in_flight)
    bound = "" if known else " (not modelled for this schedule: every microbatch, an upper bound)"
    return (
        f"  {schedule} over {microbatches} microbatches keeps up to {per_stage} in flight on"
        f" this rank{bound}, and a receive buffer per microbatch for the activation in and the gradient back"
        f" ({buffers}): in flight x kept + buffers + (peak - kept) = {peak}"
    )


def in_flight_not_modelled_note(schedule: str) -> str:
    """The estimate's note for a schedule whose microbatches in flight are not modelled."""
    return f"{schedule}: microbatches in flight not modelled; every microbatch counted as in flight (an upper bound)"


def unsharded_units_note(schedule: str, rank: int, gathered: str) -> str:
    """The report's note for a schedule that defers weight gradients (`ScheduleSpec.defers_weight_gradients`):
    FSDP keeps every unit of a stage all-gathered (`gathered` bytes, formatted) for the whole step."""
    return (
        f"{schedule} keeps every FSDP unit of a stage unsharded from forward to"
        f" backward: rank {rank}'s stages all-gathered, {gathered}, stay in memory"
        " during a step, in place of the one unit above"
    )
