"""Gradient clipping that is correct when parameters live on different meshes.

With 2D parallelism some gradients are sharded over `(shard, tensor_parallel)`, others over `shard` only, and plain
tensors are whole on every rank. `torch.nn.utils.clip_grad_norm_` stacks per-parameter norms into one tensor, which
fails when they are DTensors on different meshes (Lightning's `ModelParallelStrategy` crashes there). Here each
group of gradients sharing a layout is reduced over exactly the mesh dims it is sharded on, so nothing is counted
twice and nothing is missed.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_dpar.mesh import is_sharded

__all__ = [
    "clip_grad_norm_",
    "clip_grad_value_",
    "total_grad_norm",
]


@torch.no_grad()
def total_grad_norm(grads: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
    """The norm of all gradients as if they were one full, unsharded vector; identical on every rank."""
    grads = list(grads)
    if not grads:
        return torch.tensor(0.0)
    local_groups: dict[tuple, list[Tensor]] = defaultdict(list)
    layouts: dict[tuple, DTensor | None] = {}
    for grad in grads:
        if isinstance(grad, DTensor):
            key = (id(grad.device_mesh), grad.placements)
            layouts[key] = grad
            local_groups[key].append(grad.to_local())
        else:
            layouts[(None, None)] = None
            local_groups[(None, None)].append(grad)

    device = grads[0].device if not isinstance(grads[0], DTensor) else grads[0].to_local().device
    is_inf = math.isinf(norm_type)
    total = torch.zeros((), device=device, dtype=torch.float32)
    for key, tensors in local_groups.items():
        norms = torch.stack([torch.linalg.vector_norm(t.float(), norm_type) for t in tensors])
        part = norms.max() if is_inf else norms.pow(norm_type).sum()
        part = part.to(device)
        sample = layouts[key]
        if sample is not None:
            mesh = sample.device_mesh
            for mesh_dim, placement in enumerate(sample.placements):
                if is_sharded(placement) and mesh.size(mesh_dim) > 1:
                    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
                    dist.all_reduce(part, op=op, group=mesh.get_group(mesh_dim))
        total = torch.maximum(total, part) if is_inf else total + part
    return total if is_inf else total.pow(1.0 / norm_type)


def _local(grad: Tensor) -> Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0) -> Tensor:
    """Scale gradients in place so their global norm is at most `max_norm`; returns the norm before clipping."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total = total_grad_norm(grads, norm_type)
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        local = _local(grad)
        local.mul_(clip_coef.to(device=local.device, dtype=local.dtype))
    return total


@torch.no_grad()
def clip_grad_value_(parameters: Iterable[Tensor], clip_value: float) -> None:
    """Clamp every gradient element to `[-clip_value, clip_value]` (elementwise, so shards clip independently)."""
    for p in parameters:
        if p.grad is not None:
            _local(p.grad).clamp_(min=-clip_value, max=clip_value)
