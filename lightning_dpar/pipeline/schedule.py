"""Pipeline schedules by name, and the microbatch counts each one accepts, checked before any process group exists.

The schedules are torch's (`torch.distributed.pipelining`); this module only names them, says which stage placement
each needs (one stage per rank, several in a loop, or two in a V) and what it requires of the microbatch count, so
a bad combination fails on every rank with one message instead of inside the first step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.torch_version import TorchVersion

from lightning_dpar.pipeline.split import StagePlacement, check_placement

__all__ = ["SCHEDULES", "ScheduleSpec", "build_schedule", "schedule_spec"]


@dataclass(frozen=True)
class ScheduleSpec:
    """A schedule's name, torch class, whether it drives several stages per rank, and their placement."""

    name: str
    schedule_class: type
    multi_stage: bool
    placement: StagePlacement
    needs_microbatches_per_stage: bool = False
    needs_whole_rounds: bool = False
    #: Zero-bubble schedules compute weight gradients apart from input gradients, from the parameters registered on
    #: each module: FSDP must keep them unsharded from forward to backward (`reshard_after_forward=False`).
    defers_weight_gradients: bool = False
    description: str = ""

    def check_runs_on(self, device_type: str, torch_version: str = torch.__version__) -> None:
        """Raise if this torch cannot run the schedule on `device_type`'s backend.

        A V schedule places two adjacent stages on the last rank. Before its first step, torch 2.11's schedule sends
        a message from each stage to its neighbour stages, the one on the same rank included, and gloo (the CPU
        backend) cannot send to its own rank ("Pair is not connected"); torch 2.13 sends no such message. Checked:
        2.11.0 fails, 2.13.0 and 2.15.0 run; 2.12 was not tried, so it is refused with 2.11.
        """
        if self.placement == "v" and device_type == "cpu" and TorchVersion(torch_version) < (2, 13):
            others = [spec.name for spec in SCHEDULES.values() if spec.placement != "v"]
            raise ValueError(
                f"Schedule {self.name!r} on the CPU (gloo) needs torch 2.13 or newer; this is torch {torch_version},"
                " whose pipeline sends a message between the two stages a V places on one rank, which gloo cannot"
                f" do. Upgrade torch (`pip install 'torch>=2.13'`), or choose another schedule: {others}."
            )

    def check(self, num_microbatches: int, stages_per_rank: int, num_ranks: int) -> None:
        """Raise if this schedule cannot run `num_microbatches` over `num_ranks * stages_per_rank` stages."""
        if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ValueError(f"`pipeline_microbatches={num_microbatches!r}` is invalid: expected a positive integer.")
        if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1:
            raise ValueError(f"`pipeline_stages_per_rank={stages_per_rank!r}` is invalid: expected a positive integer.")
        if not self.multi_stage and stages_per_rank != 1:
            looped = [spec.name for spec in SCHEDULES.values() if spec.multi_stage]
            raise ValueError(
                f"Schedule {self.name!r} runs one stage per rank, but `pipeline_stages_per_rank={stages_per_rank}`."
                f" Set it to 1, or use a schedule that runs several: {looped}."
            )
        check_placement(self.placement, stages_per_rank, f"Schedule {self.name!r}")
        num_stages = num_ranks * stages_per_rank
        if self.needs_microbatches_per_stage and num_microbatches < num_stages:
            raise ValueError(
                f"Schedule {self.name!r} needs at least as many microbatches as stages: got"
                f" `pipeline_microbatches={num_microbatches}` for {num_stages} stages. Use"
                f" `pipeline_microbatches>={num_stages}`, or 'GPipe', which takes any number."
            )
        rounds = max(1, num_microbatches // num_ranks)
        if self.needs_whole_rounds and num_microbatches % rounds:
            raise ValueError(
                f"Schedule {self.name!r} runs microbatches in rounds of the pipeline size {num_ranks}:"
                f" `pipeline_microbatches={num_microbatches}` is not a multiple of its {rounds} rounds. Use a multiple"
                f" of {num_ranks}, or fewer microbatches than {num_ranks}."
            )

    def bubble(self, num_ranks: int, num_microbatches: int, stages_per_rank: int) -> float | None:
        """The idle fraction of an ideal step (equal stage times, no communication) on `num_ranks` pipeline ranks,
        where the schedule has a known closed form: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for
        Interleaved1F1B (v stages per rank); None for the others."""
        p, m, v = num_ranks, num_microbatches, stages_per_rank
        if self.name in ("GPipe", "1F1B"):
            return (p - 1) / (m + p - 1)
        if self.name == "Interleaved1F1B":
            return (p - 1) / (v * m + p - 1)
        return None

    def microbatches_in_flight(
        self, num_ranks: int, num_microbatches: int, stages_per_rank: int, pipeline_rank: int
    ) -> tuple[int, ...] | None:
        """The most microbatches whose activations `pipeline_rank` holds at once (forwards run, backwards not yet),
        per stage of that rank in execution order, as torch's schedules order their actions; None for the
        zero-bubble schedules, whose deferred weight gradients keep activations by rules not modelled here.

        GPipe: all `m` (every forward runs before any backward). 1F1B: stage `r` runs `min(m, p - r)` warm-up forwards
        before its first backward, then alternates. Interleaved1F1B: `min((v-1)*k + 2*(p-1-r), v*m)` warm-up forwards
        (`k` microbatches per round) plus the first steady forward, each round of `k` going to the next local stage.
        LoopedBFS: every microbatch of every local stage runs forward before the backwards."""
        p, m, v, r = num_ranks, num_microbatches, stages_per_rank, pipeline_rank
        if self.name == "GPipe":
            return (m,)
        if self.name == "1F1B":
            return (min(m, p - r),)
        if self.name == "LoopedBFS":
            return (m,) * v
        if self.name == "Interleaved1F1B":
            per_round = m // max(1, m // p)
            forwards = min((v - 1) * per_round + 2 * (p - 1 - r) + 1, v * m)
            counts = [0] * v
            for step in range(forwards):
                counts[(step // per_round) % v] += 1
            return tuple(counts)
        return None


SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name.lower(): spec
    for spec in (
        ScheduleSpec("GPipe", ScheduleGPipe, False, "loop", description="all forwards, then all backwards"),
        ScheduleSpec(
            "1F1B",
            Schedule1F1B,
            False,
            "loop",
            needs_microbatches_per_stage=True,
            description="one forward, one backward: at most p microbatches' activations alive",
        ),
        ScheduleSpec(
            "Interleaved1F1B",
            ScheduleInterleaved1F1B,
            True,
            "loop",
            needs_whole_rounds=True,
            description="1F1B over several stages per rank: a smaller bubble for more communication",
        ),
        ScheduleSpec("LoopedBFS", ScheduleLoopedBFS, True, "loop", description="breadth-first over looped stages"),
        ScheduleSpec(
            "InterleavedZeroBubble",
            ScheduleInterleavedZeroBubble,
            True,
            "loop",
            needs_whole_rounds=True,
            defers_weight_gradients=True,
            description="interleaved 1F1B with weight gradients deferred into the bubble",
        ),
        ScheduleSpec(
            "ZBVZeroBubble",
            ScheduleZBVZeroBubble,
            True,
            "v",
            needs_microbatches_per_stage=True,
            defers_weight_gradients=True,
            description="zero bubble with 2 stages per rank in a V",
        ),
    )
}


def schedule_spec(name: str) -> ScheduleSpec:
    """The schedule called `name` (case-insensitive)."""
    if not isinstance(name, str) or name.lower() not in SCHEDULES:
        names = [spec.name for spec in SCHEDULES.values()]
        described = "; ".join(f"{spec.name}: {spec.description}" for spec in SCHEDULES.values())
        raise ValueError(
            f"`pipeline_schedule={name!r}` is not a pipeline schedule. Choose one of {names} ({described})."
        )
    return SCHEDULES[name.lower()]


def build_schedule(
    spec: ScheduleSpec,
    stages: Sequence[PipelineStage],
    num_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> object:
    """A torch schedule over this rank's stages. Gradients are not rescaled by the schedule (`scale_grads=False`):
    `loss_fn` scales each microbatch's loss itself, which stays right under gradient accumulation."""
    if spec.multi_stage:
        return spec.schedule_class(list(stages), num_microbatches, loss_fn=loss_fn, scale_grads=False)
    (stage,) = stages
    return spec.schedule_class(stage, num_microbatches, loss_fn=loss_fn, scale_grads=False)
