"""Pipeline parallelism's pricing for the layout search: the schedules offered and refused, each rank's share of the
layers, the bubble, the stage boundaries' sends and FSDP's gathers per step."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.pipeline.cost import (
    MODELLED_SCHEDULES,
    PipelineChoice,
    PipelineRefusal,
    bubble_seconds,
    parameter_gathers,
    per_rank,
    pipeline_choices,
    stage_boundary_seconds,
)


@dataclass(frozen=True)
class Pipelined:
    """A layout as the pricing reads it."""

    dims: ParallelDims
    schedule: str | None = None
    microbatches: int = 1
    stages_per_rank: int = 1


@dataclass(frozen=True)
class ByteLink:
    """A link moving one byte per second, with no latency."""

    def seconds(self, nbytes: float, steps: int = 1) -> float:
        return nbytes


def dims(pp: int = 1, cp: int = 1) -> ParallelDims:
    return ParallelDims(world_size=4 * pp, replicate=1, shard=4, tensor_parallel=1, pipeline=pp, context=cp)


def test_every_modelled_schedule_with_one_and_two_microbatches_per_stage():
    choices = list(pipeline_choices(2, layers=8, batch_size=8))
    assert choices == [
        PipelineChoice("1F1B", 2, 1),
        PipelineChoice("1F1B", 4, 1),
        PipelineChoice("GPipe", 2, 1),
        PipelineChoice("GPipe", 4, 1),
        PipelineChoice("Interleaved1F1B", 2, 2),
        PipelineChoice("Interleaved1F1B", 4, 2),
    ]
    assert [c.schedule for c in choices[::2]] == list(MODELLED_SCHEDULES)


def test_too_few_layers_and_an_indivisible_batch_are_refused_with_the_reason():
    refusals = [c for c in pipeline_choices(2, layers=3, batch_size=2) if isinstance(c, PipelineRefusal)]
    assert PipelineRefusal("pp2 Interleaved1F1B", "4 stages need at least as many layers; the model has 3") in refusals
    assert PipelineRefusal("pp2 1F1B m4", "the per-rank batch size 2 does not divide into 4 microbatches") in refusals
    assert not any(isinstance(c, PipelineChoice) and c.microbatches == 4 for c in pipeline_choices(2, 3, 2))


def test_each_rank_holds_its_share_of_the_layers_rounded_up():
    assert per_rank(8, dims()) == 8
    assert per_rank(8, dims(pp=2)) == 4
    assert per_rank(7, dims(pp=2)) == 4
    assert per_rank(0, dims(pp=2)) == 0


def test_fsdp_gathers_twice_per_step_and_per_microbatch_under_pipelining():
    assert parameter_gathers(Pipelined(dims(), microbatches=1)) == 2
    assert parameter_gathers(Pipelined(dims(pp=2), "1F1B", microbatches=4)) == 8


@pytest.mark.parametrize("schedule, microbatches", [("GPipe", 2), ("1F1B", 4)])
def test_the_bubble_is_the_schedules_idle_share_of_the_step(schedule, microbatches):
    # (p - 1) / (m + p - 1) idle: with 2 ranks, 1 / 3 for 2 microbatches, 1 / 5 for 4
    fraction = 1 / (microbatches + 1)
    bubble = bubble_seconds(1.0, Pipelined(dims(pp=2), schedule, microbatches))
    assert bubble == pytest.approx(fraction / (1 - fraction))
    assert bubble_seconds(1.0, Pipelined(dims())) == 0.0


def test_the_boundaries_send_each_microbatchs_activation_forward_and_its_gradient_back():
    assert stage_boundary_seconds(Pipelined(dims(pp=2), "1F1B", 4), 1000, ByteLink()) == 2 * 4 * 1000
    assert stage_boundary_seconds(Pipelined(dims(pp=2), "Interleaved1F1B", 4, 2), 1000, ByteLink()) == 2 * 4 * 2 * 1000
    # under context parallelism a rank sends its part of the sequence
    assert stage_boundary_seconds(Pipelined(dims(pp=2, cp=2), "1F1B", 2), 1000, ByteLink()) == 2 * 2 * 500
    assert stage_boundary_seconds(Pipelined(dims()), 1000, ByteLink()) == 0.0
