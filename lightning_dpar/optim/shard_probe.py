"""The optimizer check on the layout the optimizer will really see: small DTensors placed as its parameters.

The probe of `lightning_dpar.optim.exactness` steps an unknown optimizer on plain tensor pieces, without collectives: a
piece that ends unlike the whole shows that the update is not elementwise. That alone does not show that it is
inexact on shards. An optimizer written with ordinary tensor operations (`p.norm()`, `p.grad.norm()`, sums, matrix
products) receives DTensors under FSDP and tensor parallelism, and DTensor computes those operations on the whole
tensor (a norm is reduced across the shards): such an update is exact on shards although it is not elementwise.

So, when the plain probe finds an update that is not elementwise and the layout splits parameters,
`probe_on_shards` steps it again where it will run: for each device mesh of the optimizer's split parameters, a fresh
instance of the same class and hyperparameters steps one small float64 matrix per distinct placement of those
parameters (the same mesh, the same placements, `_StridedShard` included), as DTensors, and another steps the same
matrices whole on this rank; the DTensors, gathered, must end where the whole ones do. An update that reads shards
as plain tensors (`p.to_local()`, per-shard statistics) ends elsewhere and is refused.

This probe uses collectives (the DTensor operations, the gather): every rank of each mesh runs the same steps on
the same placements, so they stay in step; the strategy then shares each rank's verdict with every rank
(`agreed`), so that all raise the same error or none does, before the first training step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.optim import Optimizer

from lightning_dpar.optim.update_probe import PROBE_RTOL, PROBE_STEPS, fresh_instance, group_hyperparameters

__all__ = ["agreed", "probe_on_shards"]


def probe_on_shards(optimizer: Optimizer) -> tuple[bool, str]:
    """Whether `optimizer`'s class, with each of its param groups' hyperparameters, steps small DTensors laid out as
    its split parameters exactly as it steps them whole; and, when not, how far apart they ended (else "")."""
    layouts = _split_layouts(optimizer)
    name = type(optimizer).__name__
    for hyper in group_hyperparameters(optimizer):
        for mesh, mesh_layouts in layouts.items():
            try:
                difference, size = _compare(optimizer, hyper, mesh, mesh_layouts)
            except Exception as error:  # raised alike on every rank of the mesh (sharding propagation runs first)
                return False, (
                    f"a copy of {name} could not step small DTensors placed as its parameters"
                    f" ({type(error).__name__}: {error})"
                )
            if difference > PROBE_RTOL * size + 1e-300:
                where = "; ".join(f"{', '.join(map(repr, p))} ({n}-D)" for p, n in mesh_layouts)
                return False, (
                    f"a copy stepped on small DTensors placed as its parameters ({where} on a mesh of"
                    f" {tuple(mesh.shape)}) ended up to {difference:.3g} away from the same tensors stepped whole"
                    f" (whose largest update is {size:.3g})"
                )
    return True, ""


def agreed(local: Callable[[Optimizer], tuple[bool, str]]) -> Callable[[Optimizer], tuple[bool, str]]:
    """`local`, with every rank's verdict gathered: exact only where every rank found it exact; the reason of the
    first rank that did not, on every rank (pipeline stages hold different parameters, hence different meshes)."""

    def check(optimizer: Optimizer) -> tuple[bool, str]:
        verdict = local(optimizer)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return verdict
        verdicts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, verdict)
        return next((v for v in verdicts if not v[0]), (True, ""))

    return check


#: A parameter's layout as the probe copies it: its placements and its number of dims.
Layout = tuple[tuple[Placement, ...], int]


def _split_layouts(optimizer: Optimizer) -> dict[DeviceMesh, list[Layout]]:
    """The distinct layouts of the optimizer's parameters split across ranks, by mesh, in parameter order."""
    layouts: dict[DeviceMesh, list[Layout]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not isinstance(param, DTensor) or param.ndim == 0:
                continue
            mesh, placements = param.device_mesh, tuple(param.placements)
            if not any(isinstance(p, Shard) and mesh.size(d) > 1 for d, p in enumerate(placements)):
                continue
            if (placements, param.ndim) not in layouts.setdefault(mesh, []):
                layouts[mesh].append((placements, param.ndim))
    return layouts


def _shape(mesh: DeviceMesh, layout: Layout) -> list[int]:
    """A small tensor of the parameter's dims, each split dim 3 per shard (even), the first two others 5 long and
    any further ones 2."""
    placements, ndim = layout
    ways = [1] * ndim
    for d, p in enumerate(placements):
        if isinstance(p, Shard):
            ways[p.dim] *= mesh.size(d)
    return [3 * w if w > 1 else (5 if i < 2 else 2) for i, w in enumerate(ways)]


def _compare(
    optimizer: Optimizer, hyper: dict[str, Any], mesh: DeviceMesh, layouts: list[Layout]
) -> tuple[float, float]:
    """The largest difference between the DTensors stepped and the same tensors stepped whole, and the largest
    update of the whole ones."""
    generator = torch.Generator().manual_seed(0)
    cpu = {"dtype": torch.float64, "device": "cpu"}
    starts, grads = [], []
    for layout in layouts:
        shape = _shape(mesh, layout)
        # Rows (and columns) of different scales, so that statistics of a shard differ from the whole's.
        scale = torch.logspace(-1, 1, shape[0], **cpu).reshape(-1, *[1] * (len(shape) - 1))
        if len(shape) > 1:
            scale = scale * torch.linspace(0.5, 2, shape[1], **cpu).reshape(1, -1, *[1] * (len(shape) - 2))
        starts.append(torch.randn(shape, generator=generator, **cpu))
        grads.append([torch.randn(shape, generator=generator, **cpu) * scale for _ in range(PROBE_STEPS)])
    whole = _step(optimizer, hyper, starts, grads)
    device = torch.device(mesh.device_type)

    def place(tensor: Tensor, layout: tuple[Placement, ...]) -> DTensor:
        replicated = DTensor.from_local(tensor.to(device), mesh, [Replicate()] * mesh.ndim, run_check=False)
        return replicated.redistribute(mesh, layout)  # each rank keeps its slice: no communication

    placed = [place(s, p) for s, (p, _) in zip(starts, layouts)]
    placed_grads = [[place(g, p) for g in gs] for gs, (p, _) in zip(grads, layouts)]
    stepped = [s.full_tensor().cpu() for s in _step(optimizer, hyper, placed, placed_grads)]
    difference = max((a - b).abs().max().item() for a, b in zip(stepped, whole))
    size = max((w - s).abs().max().item() for w, s in zip(whole, starts))
    return difference, size


def _step(optimizer: Optimizer, hyper: dict[str, Any], starts: list[Tensor], grads: list[list[Tensor]]) -> list[Tensor]:
    """Step a fresh instance of `optimizer`'s class on copies of `starts` with `grads` (per tensor, per step)."""
    params = [torch.nn.Parameter(s.clone()) for s in starts]
    probe = fresh_instance(optimizer, hyper, params)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for step in range(PROBE_STEPS):
            for param, param_grads in zip(params, grads):
                param.grad = param_grads[step].clone()
            probe.step()
    return [p.detach() for p in params]
