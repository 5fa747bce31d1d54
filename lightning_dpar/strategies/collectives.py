"""Lightning's collective hooks, as one mixin of `DparStrategy`: barrier, broadcast, and reductions and gathers over
the data-parallel group by default (tensor-parallel peers hold identical values, so reducing over them too would
count each value several times), and decisions every rank takes alike over the whole world."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.parallel import ParallelStrategy
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_dpar._private_api import sync_ddp_if_available
from lightning_dpar.parallel_dims import ParallelMeshes

__all__ = ["Collectives"]


class Collectives(ParallelStrategy):
    """The collective hooks of `DparStrategy`, which builds the data-parallel mesh (in `setup_environment`)."""

    #: Every mesh of the run; its `data_parallel` mesh holds the ranks that see different batches.
    meshes: ParallelMeshes | None

    #: `(mesh, its process group)`: `DeviceMesh.get_group` resolves the group by name on every call, and `reduce`
    #: (each `self.log(..., sync_dist=True)`) asks for it every step.
    _data_parallel_group_of: tuple[DeviceMesh, dist.ProcessGroup] | None = None

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """Ranks that see different batches; metrics and logged values reduce over this group only."""
        mesh = self.meshes.data_parallel if self.meshes is not None else None
        if mesh is None:
            return None
        if self._data_parallel_group_of is None or self._data_parallel_group_of[0] is not mesh:
            self._data_parallel_group_of = (mesh, mesh.get_group())
        return self._data_parallel_group_of[1]

    def sync_metrics_over_data_parallel(self, module: torch.nn.Module) -> None:
        """torchmetrics `Metric`s sync over data-parallel peers only; TP peers hold the same values."""
        from torchmetrics import Metric

        for metric in module.modules():
            if isinstance(metric, Metric):
                metric.process_group = self.data_parallel_group

    @override
    def barrier(self, name: str | None = None) -> None:
        if not dist.is_initialized() or name == "Trainer.save_checkpoint":
            # Lightning's barrier after each save: a synchronous save already ends in a collective on which every
            # rank learns its outcome, and an async one must not wait for anything; it would only add a round trip.
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        objects = [obj]
        dist.broadcast_object_list(objects, src)
        return objects[0]

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """Reduce over the data-parallel group by default: tensor-parallel peers hold identical values. A DTensor (a
        loss computed by `loss_parallel=True`, replicated on every tensor-parallel rank) is reduced as its whole value
        (`full_tensor()`: no communication for a replicated one), as c10d's collectives take plain tensors only."""
        if not isinstance(tensor, Tensor):
            return tensor
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        return sync_ddp_if_available(tensor, group if group is not None else self.data_parallel_group, reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Gather from data-parallel peers by default (one entry per distinct batch)."""
        return super().all_gather(tensor, group if group is not None else self.data_parallel_group, sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # Over the whole world: every rank must take the same decision (early stopping, checkpointing).
        if not dist.is_initialized():
            return decision
        flag = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        return bool(flag == self.world_size) if all else bool(flag)
