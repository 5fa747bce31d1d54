"""`ScheduleSpec.microbatches_in_flight` (`lightning_dpar/pipeline/schedule.py`): how many microbatches' activations
each schedule keeps at once, checked against the action lists torch's own schedules run."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, ScheduleLoopedBFS, _ComputationType

from lightning_dpar.pipeline.schedule import schedule_spec


def _in_flight_of_actions(actions, stages: list[int]) -> tuple[int, ...]:
    """The most forwards whose backward has not run, per stage, at the moment their total is largest."""
    live = dict.fromkeys(stages, 0)
    best = tuple(live.values())
    for action in actions:
        if action is None:
            continue
        if action.computation_type == _ComputationType.FORWARD:
            live[action.stage_index] += 1
        elif action.computation_type == _ComputationType.FULL_BACKWARD:
            live[action.stage_index] -= 1
        if sum(live.values()) > sum(best):
            best = tuple(live.values())
    return best


@pytest.mark.parametrize(("ranks", "microbatches"), [(4, 4), (4, 8), (4, 12), (2, 6), (4, 2)])
def test_interleaved_1f1b_in_flight_is_that_of_torchs_action_list(ranks, microbatches):
    schedule = object.__new__(ScheduleInterleaved1F1B)  # the action list needs sizes only, no stages
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = ranks, 2, microbatches
    schedule.number_of_rounds = max(1, microbatches // ranks)
    schedule.microbatches_per_round = microbatches // schedule.number_of_rounds
    spec = schedule_spec("Interleaved1F1B")
    for rank in range(ranks):
        actions = schedule._calculate_single_rank_operations(rank)
        expected = _in_flight_of_actions(actions, [rank, rank + ranks])
        assert spec.microbatches_in_flight(ranks, microbatches, 2, rank) == expected, rank


def test_looped_bfs_keeps_every_microbatch_of_every_stage():
    schedule = object.__new__(ScheduleLoopedBFS)
    schedule.pp_group_size, schedule._n_microbatches, schedule._stages = 2, 3, [None, None]
    actions = schedule._calculate_single_rank_operations(1)
    assert schedule_spec("LoopedBFS").microbatches_in_flight(2, 3, 2, 1) == _in_flight_of_actions(actions, [1, 3])


def test_gpipe_keeps_all_microbatches_1f1b_at_most_the_stages_after_it():
    assert schedule_spec("GPipe").microbatches_in_flight(4, 8, 1, 0) == (8,)
    assert [schedule_spec("1F1B").microbatches_in_flight(4, 8, 1, r) for r in range(4)] == [(4,), (3,), (2,), (1,)]
    assert schedule_spec("1F1B").microbatches_in_flight(4, 2, 1, 0) == (2,)
    assert schedule_spec("ZBVZeroBubble").microbatches_in_flight(4, 8, 2, 0) is None


def test_a_v_schedule_on_the_cpu_is_refused_on_torch_older_than_2_13():
    """Issue 31: on torch 2.11 `ZBVZeroBubble` over gloo failed in its first step ("Pair is not connected"), measured
    on 2 ranks (`tests/launched/test_pipeline.py`); it is refused before any collective instead."""
    spec = schedule_spec("ZBVZeroBubble")
    with pytest.raises(
        ValueError, match=r"'ZBVZeroBubble' on the CPU \(gloo\) needs torch 2.13 or newer; this is torch 2.11.0"
    ):
        spec.check_runs_on("cpu", "2.11.0+cu130")
    with pytest.raises(ValueError, match="Interleaved1F1B"):  # the schedules that run there are named
        spec.check_runs_on("cpu", "2.12.1")
    spec.check_runs_on("cpu", "2.13.0+cpu")
    spec.check_runs_on("cuda", "2.11.0")
    schedule_spec("Interleaved1F1B").check_runs_on("cpu", "2.11.0")
