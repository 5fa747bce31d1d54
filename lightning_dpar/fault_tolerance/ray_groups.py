"""A fault-tolerant strategy inside a Ray Train worker of `TorchTrainer(torch_config=TorchftConfig(...))`.

Ray Train 2.60's `TorchftConfig` starts a torchft lighthouse (its address in `$TORCHFT_LIGHTHOUSE`), splits the
workers into replica groups (one worker each in 2.60), gives each group a process group of its own, and when a
worker dies restarts only its group. Ray's `DistributedContext` still numbers the workers across the whole job, so
`prepare_replica_group` tells the strategy what its launch is: this worker's replica group (world rank // group
size) out of world size / group size, and a cluster environment of the group's ranks only.
`lightning_dpar.ray.prepare_trainer` calls it for the fault-tolerant strategies.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from lightning.fabric.plugins import ClusterEnvironment

from lightning_dpar.fault_tolerance.config import check_world_split

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch

__all__ = ["ReplicaGroupEnvironment", "prepare_replica_group"]


class ReplicaGroupEnvironment(ClusterEnvironment):
    """The ranks of one replica group, started by Ray: this worker is `group_rank` of `group_size` on one node, its
    process group's store at `$MASTER_ADDR:$MASTER_PORT` (set per group by Ray's torch backend)."""

    def __init__(self, group_rank: int, group_size: int) -> None:
        self._group_rank = group_rank
        self._group_size = group_size

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ["MASTER_ADDR"]

    @property
    def main_port(self) -> int:
        return int(os.environ["MASTER_PORT"])

    @staticmethod
    def detect() -> bool:
        return False

    def world_size(self) -> int:
        return self._group_size

    def set_world_size(self, size: int) -> None:
        pass  # fixed by the group

    def global_rank(self) -> int:
        return self._group_rank

    def set_global_rank(self, rank: int) -> None:
        pass  # fixed by the group

    def local_rank(self) -> int:
        return self._group_rank

    def node_rank(self) -> int:
        return 0


def prepare_replica_group(trainer: pl.Trainer, device: torch.device, world_rank: int, world_size: int) -> None:
    """Make `trainer`'s fault-tolerant strategy one replica group of Ray's workers: group `world_rank // group_size`
    of `world_size // group_size`, `FaultTolerance.group_size` (default 1, Ray 2.60's only size) ranks on one node.
    Raises `ValueError` when the group size does not divide Ray's workers."""
    strategy: Any = trainer.strategy
    config = strategy.fault_tolerance
    group_size = config.group_size or 1
    groups = check_world_split(world_size, group_size)
    strategy._fault_tolerance = replace(
        config,
        replica_group=world_rank // group_size if config.replica_group is None else config.replica_group,
        num_replica_groups=groups if config.num_replica_groups is None else config.num_replica_groups,
        group_size=group_size,
    )
    strategy.cluster_environment = ReplicaGroupEnvironment(world_rank % group_size, group_size)
    strategy.parallel_devices = [device] * group_size
    strategy.num_nodes = 1
