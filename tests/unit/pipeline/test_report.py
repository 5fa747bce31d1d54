"""`lightning_dpar.pipeline.report`: the `plan` dry run's pipeline section on stages whose memory is given by hand
(the bubble, the stage table, what each pipeline rank holds). The section in whole dry runs:
`tests/unit/estimates/test_dry_run.py`."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from lightning_dpar.pipeline.report import PipelineReport, StageRow, describe_units


@dataclass(frozen=True)
class _Memory:
    parameters: int
    gradients: int
    optimizer: int | None

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + (self.optimizer or 0)


@dataclass(frozen=True)
class _Peaks:
    peaks: tuple[int, ...]

    def peak(self, pipeline_rank: int = 0) -> int:
        return self.peaks[pipeline_rank]


@pytest.mark.parametrize(
    ("schedule", "ranks", "microbatches", "per_rank", "expected"),
    [("1F1B", 4, 8, 1, 3 / 11), ("GPipe", 2, 2, 1, 1 / 3), ("Interleaved1F1B", 4, 8, 2, 3 / 19)],
)
def test_the_pipeline_reports_bubble_is_the_schedules_idle_fraction(schedule, ranks, microbatches, per_rank, expected):
    report = PipelineReport(schedule, microbatches, False, per_rank, "even", [], ranks)
    assert report.bubble == pytest.approx(expected)


def test_consecutive_units_of_a_repeated_block_are_shown_as_a_range():
    assert describe_units(["model.emb", "model.blocks.0", "model.blocks.1", "model.blocks.2"]) == (
        "model.emb, model.blocks.0-2"
    )
    assert describe_units(["blocks.1", "blocks.3", "head"]) == "blocks.1, blocks.3, head"


def test_the_section_has_a_row_per_stage_and_each_ranks_share_with_several_stages_per_rank():
    rows = [
        StageRow(stage, stage % 2, range(2 * (stage % 2), 2 * (stage % 2) + 2), (f"blocks.{stage}",), 1000, memory)
        for stage, memory in enumerate([_Memory(1024, 1024, 2048), _Memory(2048, 2048, None)] * 2)
    ]
    report = PipelineReport("Interleaved1F1B", 4, True, 2, "'auto'", sorted(rows, key=lambda r: r.stage), 2)
    lines = report.render(_Peaks((3 * 1024, 5 * 1024)))
    assert lines[:3] == [
        "Pipeline: schedule Interleaved1F1B, 4 microbatches per batch (default: one per stage), 2 stages per pipeline"
        " rank, split 'auto'",
        "  each data-parallel rank's batch size must be a multiple of 4",
        "  bubble (idle fraction of an ideal step): 11%; more microbatches make it smaller",
    ]
    header = "stage pipeline rank ranks units parameters params/rank grads/rank optimizer/rank total/rank"
    assert " ".join(lines[3].split()) == f"{header} activations/rank"
    assert " ".join(lines[4].split()) == "0 0 0-1 blocks.0 1,000 1.00 KiB 1.00 KiB 2.00 KiB 4.00 KiB 3.00 KiB"
    assert "unknown" in lines[5]  # stage 1's optimizer state size is not known
    assert lines[-2:] == [
        "  pipeline rank 0 holds stages 0, 2: 8.00 KiB per rank",
        "  pipeline rank 1 holds stages 1, 3: 8.00 KiB per rank",
    ]
    assert "activations/rank" not in report.render()[3]


def test_the_section_of_a_strategys_settings_names_its_schedule_microbatches_and_split():
    from lightning_dpar.pipeline.config import PipelineConfig

    rows = [StageRow(s, s, range(s, s + 1), (f"blocks.{s}",), 10, _Memory(1, 1, 1)) for s in (1, 0)]
    report = PipelineReport.of(PipelineConfig.of("1F1B", None, 1, "auto"), 2, rows)
    assert (report.schedule, report.microbatches, report.microbatches_by_default) == ("1F1B", 2, True)
    assert (report.split, [row.stage for row in report.stages], report.num_ranks) == ("'auto'", [0, 1], 2)
    given = PipelineReport.of(PipelineConfig.of("GPipe", 4, 1, ["blocks.1"]), 2, rows)
    assert (given.microbatches, given.microbatches_by_default, given.split) == (4, False, "at ['blocks.1']")
