"""`torch.optim.Muon` on sharded parameters (FSDP, HSDP, tensor parallelism), exactly as under DDP.

Muon orthogonalises each weight matrix's momentum update as a whole (Newton-Schulz iterations); on a shard it would
orthogonalise a different matrix. Here, as in torchtitan's and Moonlight's distributed Muon, each matrix gets an
owner rank among the ranks that hold its shards (in rounds of as many matrices as ranks, the `j`-th rank owning the
round's `j`-th matrix, so the work is spread and no rank orthogonalises every matrix): the momentum update, computed
elementwise on each shard, is gathered; the owner runs torch's own Newton-Schulz on the whole matrix and sends the
result to the matrix's other ranks; each rank applies its slice. A rank holds one round's whole matrices at a time.
The arithmetic is torch's (`muon_newton_schulz`, `muon_adjusted_lr`) on the same whole matrix, so parameters and the
momentum state end bit for bit as under DDP. The state stays what Muon keeps, a momentum buffer shaped and sharded
like its parameter, so checkpoints save and resume it like any optimizer's.

The strategy installs it on a `torch.optim.Muon` (the exact class) when parameters are split across ranks; the
optimizer object, its hooks and its LR schedulers are unchanged. Cost per step and matrix: an all-gather of the
update and a broadcast of the (bf16) result over the matrix's ranks, and one rank's Newton-Schulz.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_dpar._private_api import (
    muon_adjusted_lr,
    muon_init_group,
    muon_newton_schulz,
    replace_muon_group_step,
)

__all__ = ["install", "supports"]


def supports(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `install` computes this optimizer's step on whole matrices: `torch.optim.Muon` itself only (a
    subclass may change the update)."""
    return type(optimizer) is torch.optim.Muon


def install(optimizer: torch.optim.Muon) -> None:
    """Make `optimizer.step` compute the update of each sharded matrix whole, on one owner rank."""

    def group_step(group: MutableMapping, params: list[Tensor], grads: list[Tensor], buffers: list[Tensor]) -> bool:
        mine: tuple[list[Tensor], list[Tensor], list[Tensor]] = ([], [], [])
        has_complex = muon_init_group(optimizer, group, *mine)
        sharded = []
        for param, grad, buffer in zip(*mine):
            if _is_split(param):
                sharded.append((param, grad, buffer))
            else:  # whole on this rank: Muon's own step, as under DDP
                params.append(param)
                grads.append(grad)
                buffers.append(buffer)
        if sharded:
            _step_sharded(group, sharded)
        return has_complex

    replace_muon_group_step(optimizer, group_step)


def _is_split(param: Tensor) -> bool:
    return isinstance(param, DTensor) and any(
        isinstance(p, Shard) and param.device_mesh.size(d) > 1 for d, p in enumerate(param.placements)
    )


def _step_sharded(group: MutableMapping, items: list[tuple[Tensor, Tensor, Tensor]]) -> None:
    """Muon's update (`torch.optim._muon._single_tensor_muon`) for sharded matrices, each orthogonalised whole.

    The matrices of a mesh go in rounds of as many matrices as the mesh has ranks: the round's updates are gathered
    (every rank holds at most one round's whole matrices), the `j`-th rank orthogonalises the `j`-th matrix, all at
    once, and each result is broadcast from its owner.
    """
    lr = group["lr"].item() if isinstance(group["lr"], Tensor) else group["lr"]
    momentum, weight_decay = group["momentum"], group["weight_decay"]
    by_mesh: dict[DeviceMesh, list[tuple[Tensor, Tensor]]] = {}
    for param, grad, buffer in items:  # elementwise on each shard, as Muon does on the whole tensor
        if grad.ndim != 2:
            raise ValueError("Param gradient must be a 2D matrix")
        buffer.lerp_(grad, 1 - momentum)
        update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
        by_mesh.setdefault(param.device_mesh, []).append((param, update))
    for mesh, pairs in by_mesh.items():
        here = list(mesh.get_coordinate() or ())
        for start in range(0, len(pairs), mesh.size()):
            round_ = pairs[start : start + mesh.size()]
            wholes = [update.full_tensor() for _, update in round_]
            results = []
            for owner, whole in enumerate(wholes):
                if _coordinate(mesh, owner) == here:
                    ns = muon_newton_schulz(whole, group["ns_coefficients"], group["ns_steps"], group["eps"])
                    results.append(ns.contiguous())
                else:
                    results.append(torch.empty(whole.shape, dtype=torch.bfloat16, device=whole.device))
            del wholes
            for owner, ((param, _), result) in enumerate(zip(round_, results)):
                _broadcast_from(result, mesh, _coordinate(mesh, owner))
                replicated = DTensor.from_local(result, mesh, [Replicate()] * mesh.ndim, run_check=False)
                local = replicated.redistribute(mesh, param.placements).to_local()  # a slice: no communication
                param.to_local().mul_(1 - lr * weight_decay)
                param.to_local().add_(local, alpha=-muon_adjusted_lr(lr, group["adjust_lr_fn"], param.shape))


def _coordinate(mesh: DeviceMesh, index: int) -> list[int]:
    """The mesh coordinate of the `index`-th rank of `mesh` in row-major order."""
    coordinate = []
    for size in reversed(mesh.shape):
        coordinate.append(index % size)
        index //= size
    return coordinate[::-1]


def _broadcast_from(tensor: Tensor, mesh: DeviceMesh, owner: list[int]) -> None:
    """Send `tensor` from the rank at mesh coordinate `owner` to every rank of `mesh`, one mesh dim at a time.

    After the step for dim `d`, every rank whose coordinates after `d` are the owner's holds the tensor: along each
    dim, the group whose other coordinates are past dims' receives it from its member at the owner's position.
    """
    here = list(mesh.get_coordinate() or ())
    for dim in range(mesh.ndim):
        if mesh.size(dim) == 1 or here[dim + 1 :] != owner[dim + 1 :]:
            continue
        source = [*here[:dim], owner[dim], *here[dim + 1 :]]
        dist.broadcast(tensor, src=int(mesh.mesh[tuple(source)].item()), group=mesh.get_group(dim))
