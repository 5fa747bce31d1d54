"""Gradient clipping that is correct when parameters live on different meshes, and cheap enough to run every step.

With 2D parallelism some gradients are sharded over `(shard, tensor_parallel)`, others over `shard` only, and plain
tensors are whole on every rank. `torch.nn.utils.clip_grad_norm_` stacks per-parameter norms into one tensor, which
fails when they are DTensors on different meshes (Lightning's `ModelParallelStrategy` crashes there). Here each
group of gradients sharing a layout is reduced over exactly the mesh dims it is sharded on, so nothing is counted
twice and nothing is missed.

Speed: which parameters form which group, and over which process groups each group reduces, depends only on the
parameters (their meshes and placements are fixed once the model is parallelised), so `GradientClipper` works it
out once and reuses it while the same parameters have gradients; a different set (another model, a second `fit`
with new parameters, a parameter without a gradient this step) rebuilds it. Each step then runs one fused
`foreach` norm and one fused `foreach` scale per group on the local shards, and one all-reduce per sharded mesh
dim, instead of a Python loop of per-parameter kernels and DTensor dispatches.

`torch._foreach_norm` / `_foreach_mul_` / `_foreach_clamp_min_` / `_foreach_clamp_max_` are the documented
"foreach" operations (torch docs, "Foreach Operations", beta) that `torch.nn.utils.clip_grad_norm_` itself uses.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_dpar.optim.nonfinite import StepFlags
from lightning_dpar.parallel_dims import is_sharded

__all__ = ["GradientClipper", "clip_grad_norm_", "clip_grad_value_", "total_grad_norm"]


def _local(grad: Tensor) -> Tensor:
    # Under `no_grad` (all callers here) `to_local` returns the local shard without an autograd node.
    return grad.to_local() if isinstance(grad, DTensor) else grad


@dataclass(frozen=True)
class _Group:
    """Positions (in the list of parameters with gradients) of gradients that share device, mesh and placements,
    and the process groups of the mesh dims they are sharded on (empty: whole on every rank)."""

    positions: tuple[int, ...]
    reduce_over: tuple[dist.ProcessGroup, ...]
    #: How many ranks those reductions reach together (distinct dims of one mesh: the product of their sizes).
    reach: int = 1


@dataclass(frozen=True)
class _GradientGroups:
    """How the gradients of one exact list of parameters group; valid while those same parameters have gradients."""

    params: tuple[weakref.ref, ...]
    groups: tuple[_Group, ...]

    @classmethod
    def of(cls, params: Sequence[Tensor]) -> _GradientGroups:
        positions: dict[tuple, list[int]] = {}
        reduce_over: dict[tuple, tuple[dist.ProcessGroup, ...]] = {}
        reach: dict[tuple, int] = {}
        for position, param in enumerate(params):
            grad = param.grad
            assert grad is not None
            if isinstance(grad, DTensor):
                mesh = grad.device_mesh
                # The mesh by value, not by object: parameters of one mesh may hold different but equal `DeviceMesh`
                # objects (which ones depends on what ran before in the process); split into groups, their norms
                # would be summed in another order, and the same run would clip differently.
                key: tuple = (_local(grad).device, mesh, grad.placements)
                if key not in reduce_over:
                    dims = [d for d, p in enumerate(grad.placements) if is_sharded(p) and mesh.size(d) > 1]
                    reduce_over[key] = tuple(mesh.get_group(dim) for dim in dims)
                    reach[key] = math.prod(mesh.size(dim) for dim in dims)
            else:
                key = (grad.device, None, None)
                reduce_over.setdefault(key, ())
            positions.setdefault(key, []).append(position)
        groups = tuple(_Group(tuple(positions[key]), reduce_over[key], reach.get(key, 1)) for key in positions)
        return cls(tuple(weakref.ref(p) for p in params), groups)

    def matches(self, params: Sequence[Tensor]) -> bool:
        return len(params) == len(self.params) and all(ref() is p for ref, p in zip(self.params, params))


class GradientClipper:
    """Mesh-aware gradient norm and clipping, with the grouping of the parameters cached between steps."""

    def __init__(self, across: Sequence[dist.ProcessGroup] = (), device: torch.device | None = None) -> None:
        self._layout: _GradientGroups | None = None
        #: Groups whose ranks hold different parameters altogether (pipeline stages): the norm adds up over them, on
        #: `device` (the rank's own: a stage without gradients still takes part, and NCCL reduces device tensors).
        self.across = tuple(across)
        self.device = device

    def _grouped_local_grads(self, parameters: Iterable[Tensor]) -> list[tuple[list[Tensor], _Group]]:
        params = [p for p in parameters if p.grad is not None]
        if not params:
            return []
        if self._layout is None or not self._layout.matches(params):
            self._layout = _GradientGroups.of(params)
        grads = [_local(p.grad) for p in params]  # type: ignore[arg-type]
        return [([grads[i] for i in group.positions], group) for group in self._layout.groups]

    @torch.no_grad()
    def total_norm(self, parameters: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
        """The norm of all gradients as if they were one full, unsharded vector; identical on every rank."""
        return self._total_norm(self._grouped_local_grads(parameters), float(norm_type))

    def _total_norm(
        self, grouped: list[tuple[list[Tensor], _Group]], norm_type: float, fold: StepFlags | None = None
    ) -> Tensor:
        """The norm; with `fold`, the non-finite step flags (`optim.nonfinite`) ride along its reductions: this
        rank's suspicion is added from the local parts before any reduction, and `fold.agreed` says whether the
        reductions reached every rank (one group's reductions with the pipeline's cover the world, and the
        flags pass through each); where they did not (replicated gradients), the guard reduces the flags itself."""
        if not grouped and not self.across:
            return torch.tensor(0.0)
        is_inf = math.isinf(norm_type)
        op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
        device = grouped[0][0][0].device if grouped else (self.device or torch.device("cpu"))
        parts = []
        for grads, _ in grouped:
            # Per-tensor norms in fp32 (bf16 gradients too), in one fused kernel per group.
            norms = torch.stack(torch._foreach_norm(grads, norm_type, dtype=torch.float32)).to(device)
            parts.append(norms.max() if is_inf else norms.pow(norm_type).sum())
        carried = None
        if fold is not None:
            for part in parts:
                fold.suspect(~torch.isfinite(part))
            across = math.prod(dist.get_world_size(group) for group in self.across)
            world = dist.get_world_size() if dist.is_initialized() else 1
            covered = any(group.reach * across == world for _, group in grouped) or (not grouped and across == world)
            carried = torch.cat([fold.values.to(device), torch.tensor([0.0 if covered else 1.0], device=device)])
        total = torch.zeros((), device=device, dtype=torch.float32)
        for part, (_, group) in zip(parts, grouped):
            part, carried = _all_reduce(part, carried, group.reduce_over, op)
            total = torch.maximum(total, part) if is_inf else total + part
        total, carried = _all_reduce(total, carried, self.across, op)
        if fold is not None:
            assert carried is not None
            fold.values, fold.agreed = carried[:-1].clone(), not bool(carried[-1])
        return total if is_inf else total.pow(1.0 / norm_type)

    @torch.no_grad()
    def clip_grad_norm_(
        self,
        parameters: Iterable[Tensor],
        max_norm: float,
        norm_type: float = 2.0,
        fold: StepFlags | None = None,
        before_scaling: Callable[[], None] | None = None,
    ) -> Tensor:
        """Scale gradients in place so their global norm is at most `max_norm`; returns the norm before clipping.
        `fold`: a non-finite step's flags, agreed along the norm's reductions; `before_scaling` runs between the
        norm and the scaling (the guard's verdict)."""
        grouped = self._grouped_local_grads(parameters)
        total = self._total_norm(grouped, float(norm_type), fold)
        if before_scaling is not None:
            before_scaling()
        clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grads, _ in grouped:
            torch._foreach_mul_(grads, clip_coef.to(grads[0].device))
        return total

    @torch.no_grad()
    def clip_grad_value_(self, parameters: Iterable[Tensor], clip_value: float) -> None:
        """Clamp every gradient element to `[-clip_value, clip_value]` (elementwise, so shards clip independently)."""
        for grads, _ in self._grouped_local_grads(parameters):
            torch._foreach_clamp_min_(grads, -clip_value)
            torch._foreach_clamp_max_(grads, clip_value)


def _all_reduce(
    value: Tensor, carried: Tensor | None, groups: Sequence[dist.ProcessGroup], op: dist.ReduceOp
) -> tuple[Tensor, Tensor | None]:
    """`value` reduced over each of `groups` in turn; `carried` (flags) in the same collectives, as one vector."""
    if carried is None:
        for group in groups:
            dist.all_reduce(value, op=op, group=group)
        return value, None
    if not groups:
        return value, carried
    vector = torch.cat([value.reshape(1), carried])
    for group in groups:
        dist.all_reduce(vector, op=op, group=group)
    return vector[0], vector[1:]


def total_grad_norm(parameters: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
    """One-off `GradientClipper().total_norm` (no cache kept)."""
    return GradientClipper().total_norm(parameters, norm_type)


def clip_grad_norm_(parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0) -> Tensor:
    """One-off `GradientClipper().clip_grad_norm_` (no cache kept)."""
    return GradientClipper().clip_grad_norm_(parameters, max_norm, norm_type)


def clip_grad_value_(parameters: Iterable[Tensor], clip_value: float) -> None:
    """One-off `GradientClipper().clip_grad_value_`."""
    GradientClipper().clip_grad_value_(parameters, clip_value)
