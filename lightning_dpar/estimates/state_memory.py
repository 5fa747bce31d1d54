"""Per-rank memory estimate for parameters, gradients and optimizer state, from the parameters a rank holds.

The estimate counts what lives for the whole run, on one rank, from the real (sharded) parameters:

- parameters: local elements x the parameter dtype's size (fp32 under "32-true" and "bf16-mixed", whose master
  weights stay fp32; bf16 under "bf16-true");
- gradients: the same, for trainable parameters only (`requires_grad`: a frozen parameter, e.g. the base model
  under LoRA, has none and FSDP reduces none for it; gradients have the parameter's shape and dtype; FSDP2 reduces
  them in fp32 under "bf16-mixed");
- optimizer state: local elements x states per element x the parameter dtype's size, for trainable parameters only
  (torch's optimizers make no state for a parameter without a gradient, even one in their parameter groups), with
  the states per element of each optimizer in `STATES_PER_PARAMETER` (Adam/AdamW: `exp_avg` and `exp_avg_sq`, +1
  with `amsgrad`; SGD: 1 momentum buffer when `momentum > 0`, else 0; ...);
- while FSDP computes a unit it all-gathers that unit's parameters in the compute dtype (bf16 under
  "bf16-mixed"): reported separately as the largest unit's size.

Not counted here: activations (they depend on batch and sequence length: `lightning_dpar.estimates.activations`
estimates them), DDP's gradient buckets, temporary buffers, the CUDA context and allocator fragmentation. Keep head-room
on top of the total."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_dpar.helpers import format_bytes, local_numel
from lightning_dpar.parallel_dims import EXPERT, TENSOR_PARALLEL, is_sharded

__all__ = [
    "STATES_PER_PARAMETER",
    "HeldState",
    "MemoryEstimate",
    "OptimizerStates",
    "estimate_memory",
    "format_bytes",
    "frozen_note",
    "gathered_fsdp_units",
    "held_state",
    "largest_fsdp_unit",
    "local_numel",
    "optimizer_states",
    "unsharded_numel",
]

#: Optimizer state tensors per parameter element, as a function of the parameter group's options.
STATES_PER_PARAMETER: dict[str, Callable[[dict], int]] = {
    "Adam": lambda group: 2 + bool(group.get("amsgrad")),
    "AdamW": lambda group: 2 + bool(group.get("amsgrad")),
    "Adamax": lambda group: 2,
    "NAdam": lambda group: 2,
    "RAdam": lambda group: 2,
    "Adadelta": lambda group: 2,
    "Adagrad": lambda group: 1,
    "SGD": lambda group: 1 if group.get("momentum", 0) else 0,
    "RMSprop": lambda group: 1 + bool(group.get("momentum", 0)) + bool(group.get("centered")),
}


def unsharded_numel(param: torch.Tensor, keep_sharded_dims: Iterable[str]) -> int:
    """Elements after all-gathering every mesh dim except `keep_sharded_dims` (e.g. FSDP's all-gather keeps TP)."""
    if not isinstance(param, DTensor):
        return param.numel()
    keep = set(keep_sharded_dims)
    names = param.device_mesh.mesh_dim_names or ()
    divisor = 1
    for dim, placement in enumerate(param.placements):
        if is_sharded(placement) and dim < len(names) and names[dim] in keep:
            divisor *= param.device_mesh.size(dim)
    return param.numel() // divisor


@dataclass(frozen=True)
class OptimizerStates:
    """States per parameter for one optimizer's parameters; `states is None` when the optimizer is not known."""

    optimizer: str
    states: int | None
    params: tuple[nn.Parameter, ...]


def optimizer_states(optimizers: Iterable[Optimizer]) -> list[OptimizerStates]:
    """One entry per (optimizer, parameter group)."""
    entries = []
    for optimizer in optimizers:
        name = type(optimizer).__name__
        rule = STATES_PER_PARAMETER.get(name)
        for group in optimizer.param_groups:
            entries.append(OptimizerStates(name, rule(group) if rule else None, tuple(group["params"])))
    return entries


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank; `optimizer is None` when some optimizer's state size is unknown. `frozen`: the part of
    `parameters` that does not train (no gradient, no optimizer state)."""

    parameters: int
    gradients: int
    optimizer: int | None
    unknown_optimizers: tuple[str, ...]
    frozen: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + (self.optimizer or 0)


def estimate_memory(module: nn.Module, optimizers: Iterable[Optimizer]) -> MemoryEstimate:
    """Persistent bytes on this rank for `module`'s parameters, their gradients and `optimizers`' state of them.

    Optimizer state is counted only for `module`'s own parameters, so the estimate of one part of a model (a pipeline
    stage, when a rank holds several) is that part's share of an optimizer built over the whole.
    """
    params = list(module.parameters())
    held = {id(p) for p in params}
    param_bytes = sum(local_numel(p) * p.element_size() for p in params)
    grad_bytes = sum(local_numel(p) * p.element_size() for p in params if p.requires_grad)
    trainable = {id(p) for p in params if p.requires_grad}
    optimizer_bytes, unknown = 0, set()
    for entry in optimizer_states(optimizers):
        if entry.states is None:
            unknown.add(entry.optimizer)
            continue
        optimizer_bytes += sum(
            local_numel(p) * p.element_size() * entry.states for p in entry.params if id(p) in held & trainable
        )
    optimizer = None if unknown else optimizer_bytes
    return MemoryEstimate(param_bytes, grad_bytes, optimizer, tuple(sorted(unknown)), param_bytes - grad_bytes)


@dataclass(frozen=True)
class HeldState:
    """Bytes one rank holds now, measured on the real tensors (the estimate's counterpart, e.g. after training):
    trainable and frozen parameters, the gradients allocated, and the optimizers' state tensors."""

    trainable: int
    frozen: int
    gradients: int
    optimizer: int
    frozen_with_gradient: tuple[str, ...]  # names of frozen parameters holding a gradient (should be none)


def held_state(module: nn.Module, optimizers: Iterable[Optimizer]) -> HeldState:
    """What this rank holds for `module`'s parameters: their local shards, gradients and optimizer state."""

    def size(t: torch.Tensor) -> int:
        return local_numel(t) * t.element_size()

    params = dict(module.named_parameters())
    trainable = sum(size(p) for p in params.values() if p.requires_grad)
    frozen = sum(size(p) for p in params.values() if not p.requires_grad)
    gradients = sum(size(p.grad) for p in params.values() if p.grad is not None)
    states = [
        value
        for optimizer in optimizers
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]
    with_grad = tuple(name for name, p in params.items() if not p.requires_grad and p.grad is not None)
    return HeldState(trainable, frozen, gradients, sum(size(t) for t in states), with_grad)


def frozen_note(estimate: MemoryEstimate) -> str:
    """`" (trainable X, frozen Y: no gradient or optimizer state)"` when some parameters are frozen, else `""`."""
    if not estimate.frozen:
        return ""
    trainable = format_bytes(estimate.parameters - estimate.frozen)
    return f"   (trainable {trainable}, frozen {format_bytes(estimate.frozen)}: no gradient or optimizer state)"


def gathered_fsdp_units(module: nn.Module, compute_dtype: torch.dtype | None) -> list[tuple[str, int]]:
    """Each FSDP unit's own parameters (not nested units') once all-gathered for compute (TP shards and expert
    parallelism's split of the experts stay), in bytes."""
    sizes = []
    for fqn, unit in module.named_modules():
        if not isinstance(unit, FSDPModule):
            continue
        nested = {
            id(p)
            for _, sub in unit.named_modules()
            if sub is not unit and isinstance(sub, FSDPModule)
            for p in sub.parameters()
        }
        size = sum(
            unsharded_numel(p, [TENSOR_PARALLEL, EXPERT])
            * (p.element_size() if compute_dtype is None else compute_dtype.itemsize)
            for p in unit.parameters()
            if id(p) not in nested
        )
        sizes.append((fqn, size))
    return sizes


def largest_fsdp_unit(module: nn.Module, compute_dtype: torch.dtype | None) -> tuple[str, int] | None:
    """The FSDP unit whose own parameters are largest once all-gathered."""
    return max(gathered_fsdp_units(module, compute_dtype), key=lambda unit: unit[1], default=None)
