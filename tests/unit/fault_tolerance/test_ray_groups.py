"""A fault-tolerant strategy as one replica group of Ray Train's `TorchftConfig` workers
(`lightning_dpar.fault_tolerance.ray_groups`); the Ray run itself: `tests/launched/test_fault_tolerance.py`."""

from __future__ import annotations

import lightning as L
import pytest
import torch

import lightning_dpar
from lightning_dpar.fault_tolerance import FaultTolerance


def test_a_ray_worker_becomes_its_replica_group():
    from lightning_dpar.fault_tolerance.ray_groups import ReplicaGroupEnvironment, prepare_replica_group

    strategy = lightning_dpar.FaultTolerantFullyShardStrategy(fault_tolerance=FaultTolerance(group_size=2))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False)
    prepare_replica_group(trainer, torch.device("cpu"), world_rank=3, world_size=4)
    config = trainer.strategy.fault_tolerance
    assert (config.replica_group, config.num_replica_groups, config.group_size) == (1, 2, 2)
    environment = trainer.strategy.cluster_environment
    assert isinstance(environment, ReplicaGroupEnvironment)
    assert (environment.global_rank(), environment.world_size(), trainer.strategy.num_nodes) == (1, 2, 1)


def test_a_ray_group_size_that_does_not_divide_the_workers():
    from lightning_dpar.fault_tolerance.ray_groups import prepare_replica_group

    strategy = lightning_dpar.FaultTolerantFullyShardStrategy(fault_tolerance=FaultTolerance(group_size=3))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False)
    with pytest.raises(ValueError, match="A replica group of 3 ranks does not divide the world of 4 ranks"):
        prepare_replica_group(trainer, torch.device("cpu"), world_rank=0, world_size=4)
