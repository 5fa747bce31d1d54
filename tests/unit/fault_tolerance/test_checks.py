"""What fault tolerance refuses before any collective (`lightning_dpar.fault_tolerance.checks`): layouts it does
not run, a launch that is not one group, Trainer settings the step protocol cannot run; each error names the value
and the fix."""

from __future__ import annotations

import pytest

from lightning_dpar.fault_tolerance.checks import check_fault_tolerance, check_trainer
from lightning_dpar.fault_tolerance.config import FaultTolerance
from lightning_dpar.parallel_dims import ParallelDims

ENV = {"TORCHFT_LIGHTHOUSE": "http://localhost:29510", "REPLICA_GROUP_ID": "1", "NUM_REPLICA_GROUPS": "2"}


def _dims(pipeline: int = 1, world: int = 2) -> ParallelDims:
    return ParallelDims.resolve(world_size=world, devices_per_node=world, pipeline_parallel_size=pipeline)


def test_pipeline_parallelism_is_refused_by_name(monkeypatch):
    pytest.importorskip("torchft")
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r"pipeline parallelism \(`pipeline_parallel_size=2`\) is not supported"):
        check_fault_tolerance(FaultTolerance(), _dims(pipeline=2), reach_lighthouse=False)


def test_a_launch_that_is_not_one_group(monkeypatch):
    pytest.importorskip("torchft")
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r"`FaultTolerance\(group_size=4\)` but this launch has 2 ranks"):
        check_fault_tolerance(FaultTolerance(group_size=4), _dims(), reach_lighthouse=False)


class _Trainer:
    def __init__(self, accumulate: int = 1, automatic: bool = True) -> None:
        self.accumulate_grad_batches = accumulate
        self.lightning_module = type("M", (), {"automatic_optimization": automatic})()


def test_trainer_settings_the_step_protocol_cannot_run():
    check_trainer(_Trainer(), [object()])
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=2\)` is not supported"):
        check_trainer(_Trainer(accumulate=2))
    with pytest.raises(ValueError, match="needs automatic optimisation"):
        check_trainer(_Trainer(automatic=False))
    with pytest.raises(ValueError, match="exactly one optimizer; `configure_optimizers` returned 2"):
        check_trainer(_Trainer(), [object(), object()])


def test_expert_parallelism_stays_inside_a_group(monkeypatch):
    """Expert parallelism borrows ranks from the shard dim, which lies inside a replica group: accepted."""
    pytest.importorskip("torchft")
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    dims = ParallelDims.resolve(world_size=4, devices_per_node=4, expert_parallel_size=2)
    assert dims.expert == 2
    assert check_fault_tolerance(FaultTolerance(), dims, reach_lighthouse=False).num_replica_groups == 2
