"""`lightning_dpar.pipeline.estimate`: the pipeline's arithmetic for the activation estimates and the `plan` report,
on numbers (which ranks hold a pipeline rank's stages, a stage's share of the layers, the microbatches a rank keeps
in flight, its receive buffers and activation peak) and the report's lines. The schedules' own counts:
`tests/unit/pipeline/test_schedule.py`; the estimate on a traced model: `tests/unit/estimates/test_activations.py`."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_dpar.pipeline.estimate import (
    describe_in_flight,
    in_flight_not_modelled_note,
    microbatches_in_flight,
    outputs_in_flight,
    peer_rank,
    pipeline_rank_of,
    rank_activation_peak,
    receive_buffer_bytes,
    stage_ranks,
    stage_share,
    unit_indices,
    unsharded_units_note,
)
from lightning_dpar.pipeline.schedule import schedule_spec


@dataclass(frozen=True)
class _Kept:
    retained: int
    peak: int


def test_ranks_are_row_major_with_the_pipeline_dim_outermost():
    # 8 ranks, pipeline 2: ranks 0-3 hold pipeline rank 0's stages, 4-7 pipeline rank 1's.
    assert [pipeline_rank_of(rank, 8, 2) for rank in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert stage_ranks(1, 8, 2) == range(4, 8)
    # Rank 6 is the third of pipeline rank 1's group: its peer on pipeline rank 0 is the third of that group.
    assert peer_rank(6, 0, 8, 2) == 2
    assert peer_rank(6, 1, 8, 2) == 6


def test_a_stage_holds_its_share_of_the_layers_rounded_up():
    assert stage_share(80, 4, 1) == 20
    assert stage_share(80, 3, 2) == 14  # 80 over 6 stages: the largest holds 14
    assert stage_share(7, 1, 1) == 7


def test_unit_indices_number_each_stages_units_in_call_order():
    units, indices = unit_indices([["emb", "blocks.0"], ["blocks.1"], ["blocks.2", "head"]])
    assert units == ["emb", "blocks.0", "blocks.1", "blocks.2", "head"]
    assert indices == [[0, 1], [2], [3, 4]]


def test_microbatches_in_flight_are_the_schedules_or_every_microbatch_when_not_modelled():
    assert microbatches_in_flight(None, 1, 1, 1, 0) == ((1,), True)  # no pipelining: one microbatch
    assert microbatches_in_flight(schedule_spec("1F1B"), 4, 8, 1, 1) == ((3,), True)
    assert microbatches_in_flight(schedule_spec("GPipe"), 4, 8, 1, 3) == ((8,), True)
    # Zero-bubble schedules defer weight gradients by rules not modelled: every microbatch on each stage.
    assert microbatches_in_flight(schedule_spec("ZBVZeroBubble"), 2, 4, 2, 0) == ((4, 4), False)


def test_the_last_stage_keeps_every_output_under_gpipe_only():
    assert outputs_in_flight("GPipe", 8) == 8
    assert outputs_in_flight("1F1B", 8) == 1
    assert outputs_in_flight(None, 1) == 1


def test_a_rank_keeps_its_in_flight_microbatches_its_buffers_and_one_working_set():
    stages = [_Kept(10, 15), _Kept(20, 22)]
    assert rank_activation_peak((3, 2), stages, 0) == 3 * 10 + 2 * 20 + max(15 - 10, 22 - 20)
    # A middle stage over 4 microbatches receives 8 bytes per microbatch and sends 5.
    buffers = receive_buffer_bytes(4, [(8, 5)])
    assert buffers == 4 * (8 + 5)
    assert rank_activation_peak((2,), [_Kept(10, 15)], buffers) == 2 * 10 + 52 + 5
    assert receive_buffer_bytes(1, [(0, 0)]) == 0


def test_the_report_lines():
    line = describe_in_flight("ZBVZeroBubble", 4, (4, 4), False, "1 KiB", "2 KiB")
    assert line.startswith("  ZBVZeroBubble over 4 microbatches keeps up to 4, 4 in flight on this rank (not modelled")
    assert line.endswith("(1 KiB): in flight x kept + buffers + (peak - kept) = 2 KiB")
    assert "not modelled" not in describe_in_flight("1F1B", 4, (2,), True, "1 KiB", "2 KiB")
    assert in_flight_not_modelled_note("ZBVZeroBubble").startswith("ZBVZeroBubble: microbatches in flight not modelled")
    assert unsharded_units_note("ZBVZeroBubble", 0, "1.07 MiB") == (
        "ZBVZeroBubble keeps every FSDP unit of a stage unsharded from forward to backward: rank 0's stages"
        " all-gathered, 1.07 MiB, stay in memory during a step, in place of the one unit above"
    )
