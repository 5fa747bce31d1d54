"""The pipeline-parallel settings a user gives a strategy, validated when the strategy is built."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_dpar.pipeline.schedule import ScheduleSpec, schedule_spec
from lightning_dpar.pipeline.split import SplitSpec, parse_split

__all__ = ["PipelineConfig"]


@dataclass(frozen=True)
class PipelineConfig:
    """How to pipeline: the schedule, microbatches per step, stages per rank, and where to split.

    `microbatches=None` means one per stage (the fewest every schedule accepts). The size of the pipeline mesh dim
    lives in `ParallelDims.pipeline`.
    """

    schedule: ScheduleSpec
    microbatches: int | None
    stages_per_rank: int
    split: SplitSpec
    call_order: tuple[str, ...] = ()

    @classmethod
    def of(
        cls,
        schedule: str,
        microbatches: int | None,
        stages_per_rank: int,
        split: SplitSpec | None,
        call_order: Sequence[str] | None = None,
    ) -> PipelineConfig:
        spec = schedule_spec(schedule)
        split = parse_split("auto" if split is None else split)
        if call_order is not None and (
            isinstance(call_order, str) or not all(isinstance(name, str) for name in call_order)
        ):
            raise ValueError(
                f"`pipeline_call_order={call_order!r}` is invalid: give a list of module names, in the order the"
                " forward calls them."
            )
        config = cls(spec, microbatches, stages_per_rank, split, tuple(call_order or ()))
        config.check(num_ranks=1)  # argument types and stage placement, before the world size is known
        return config

    def num_microbatches(self, num_ranks: int) -> int:
        """The microbatches per batch; by default one per stage, which every schedule accepts."""
        return self.microbatches if self.microbatches is not None else num_ranks * self.stages_per_rank

    def check(self, num_ranks: int, device_type: str | None = None) -> None:
        """Raise if the schedule cannot run on `num_ranks` pipeline ranks, or with this torch on `device_type`'s
        backend when given (before any collective)."""
        self.schedule.check(self.num_microbatches(num_ranks), self.stages_per_rank, num_ranks)
        if device_type is not None:
            self.schedule.check_runs_on(device_type)
