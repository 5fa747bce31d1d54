"""The `plan` dry run's pipeline section: the schedule, and one row per stage with what each of its ranks holds
(`PipelineReport`, `StageRow`). `lightning_dpar.estimates.dry_run` fills it in and `lightning_dpar.estimates.report`
prints it inside the whole report (and exports both names, as `lightning_dpar.estimates` does).

The report's memory and activation figures come in duck-typed (`StageMemory`, `RankPeaks`): this folder sits below
the estimates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from lightning_dpar.helpers import format_bytes, text_table
from lightning_dpar.pipeline.config import PipelineConfig
from lightning_dpar.pipeline.schedule import schedule_spec

__all__ = ["PipelineReport", "RankPeaks", "StageMemory", "StageRow", "describe_units"]


class StageMemory(Protocol):
    """Bytes one rank holds for a stage (`lightning_dpar.estimates.state_memory.MemoryEstimate`); `optimizer` is
    `None` when some optimizer's state size is unknown."""

    @property
    def parameters(self) -> int: ...

    @property
    def gradients(self) -> int: ...

    @property
    def optimizer(self) -> int | None: ...

    @property
    def total(self) -> int: ...


class RankPeaks(Protocol):
    """The activation estimate (`lightning_dpar.estimates.activations.ActivationEstimate`): a pipeline rank's peak."""

    def peak(self, pipeline_rank: int = 0) -> int: ...


@dataclass
class StageRow:
    """One pipeline stage: where it runs, what it holds, and what each of its ranks stores for it."""

    stage: int
    pipeline_rank: int
    ranks: range  # the global ranks holding this stage (one pipeline rank's group)
    units: tuple[str, ...]
    num_params: int  # the stage's parameters, whole (before tensor-parallel and FSDP sharding)
    memory: StageMemory  # on one of `ranks`: the one at the shown rank's data/tensor-parallel coordinate


@dataclass
class PipelineReport:
    """The schedule and the stages, with per-stage memory."""

    schedule: str
    microbatches: int
    microbatches_by_default: bool  # one per stage, as `pipeline_microbatches=None` gives
    stages_per_rank: int
    split: str
    stages: list[StageRow]
    num_ranks: int

    @classmethod
    def of(cls, config: PipelineConfig, num_ranks: int, stages: Sequence[StageRow]) -> PipelineReport:
        """The section for the strategy's pipeline settings on `num_ranks` pipeline ranks, its rows in stage order."""
        return cls(
            schedule=config.schedule.name,
            microbatches=config.num_microbatches(num_ranks),
            microbatches_by_default=config.microbatches is None,
            stages_per_rank=config.stages_per_rank,
            split="'auto'" if config.split == "auto" else f"at {list(config.split)}",
            stages=sorted(stages, key=lambda row: row.stage),
            num_ranks=num_ranks,
        )

    @property
    def bubble(self) -> float | None:
        """The idle fraction of an ideal step, where the schedule has a known closed form
        (`ScheduleSpec.bubble`)."""
        return schedule_spec(self.schedule).bubble(self.num_ranks, self.microbatches, self.stages_per_rank)

    def render(self, activations: RankPeaks | None = None) -> list[str]:
        """The section's lines: the schedule, a row per stage (with each pipeline rank's activation peak when
        estimated), and with several stages per rank what each pipeline rank holds."""
        default = " (default: one per stage)" if self.microbatches_by_default else ""
        stages = f"{self.stages_per_rank} stage{'s' if self.stages_per_rank > 1 else ''}"
        lines = [
            f"Pipeline: schedule {self.schedule}, {self.microbatches} microbatches per batch{default},"
            f" {stages} per pipeline rank, split {self.split}",
            f"  each data-parallel rank's batch size must be a multiple of {self.microbatches}",
        ]
        if self.bubble is not None:
            lines.append(
                f"  bubble (idle fraction of an ideal step): {self.bubble:.0%}; more microbatches make it smaller"
            )
        rows = [
            (
                str(row.stage),
                str(row.pipeline_rank),
                _ranks(row.ranks),
                describe_units(row.units),
                f"{row.num_params:,}",
                format_bytes(row.memory.parameters),
                format_bytes(row.memory.gradients),
                format_bytes(row.memory.optimizer) if row.memory.optimizer is not None else "unknown",
                format_bytes(row.memory.total),
                *([format_bytes(activations.peak(row.pipeline_rank))] if activations is not None else []),
            )
            for row in self.stages
        ]
        header = ("stage", "pipeline rank", "ranks", "units", "parameters", "params/rank", "grads/rank")
        header += ("optimizer/rank", "total/rank", *(["activations/rank"] if activations is not None else []))
        lines += text_table(rows, header)
        if self.stages_per_rank > 1:
            for pipeline_rank in range(self.num_ranks):
                held = [row for row in self.stages if row.pipeline_rank == pipeline_rank]
                total = sum(row.memory.total for row in held)
                lines.append(
                    f"  pipeline rank {pipeline_rank} holds stages {', '.join(str(r.stage) for r in held)}:"
                    f" {format_bytes(total)} per rank"
                )
        return lines


def _ranks(ranks: range) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def describe_units(units: Sequence[str]) -> str:
    """`model.emb, model.blocks.0, model.blocks.1, model.blocks.2` -> `model.emb, model.blocks.0-2`."""
    runs: list[tuple[str, int, int] | str] = []
    for fqn in units:
        prefix, _, index = fqn.rpartition(".")
        last = runs[-1] if runs else None
        if prefix and index.isdigit():
            if isinstance(last, tuple) and last[0] == prefix and last[2] == int(index) - 1:
                runs[-1] = (prefix, last[1], int(index))
            else:
                runs.append((prefix, int(index), int(index)))
        else:
            runs.append(fqn)
    return ", ".join(
        run if isinstance(run, str) else f"{run[0]}.{run[1]}" + (f"-{run[2]}" if run[2] > run[1] else "")
        for run in runs
    )
