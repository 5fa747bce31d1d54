"""FSDP units whose outputs carry FSDP's pre-backward hook without its "returned a view tensor" warning.

A tensor-parallel layer's local output (`DTensor.to_local()`, e.g. the logits of a head with a gathered output) is a
view of a tensor outside autograd. FSDP warns about every view a unit returns, on every step of every rank, though
this kind cannot lose its hook. `fully_shard_unit` makes such outputs plain aliases (same memory, no copy), which keep
FSDP's hook even through an in-place op; views of tensors autograd tracks keep torch's warning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from lightning_dpar._private_api import view_base

__all__ = ["fully_shard_unit"]


def fully_shard_unit(module: nn.Module, **kwargs: Any) -> None:
    """`fully_shard(module)`, whose outputs FSDP then sees as no views of tensors outside autograd (`_Alias`)."""
    fully_shard(module, **kwargs)
    # Prepended: runs before FSDP's own forward hook, which registers the pre-backward hooks on the outputs.
    module.register_forward_hook(_outputs_without_detached_views, prepend=True)


class _Alias(torch.autograd.Function):
    """The same tensor (same memory, no copy), no longer recorded as a view; gradients pass through unchanged."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _outputs_without_detached_views(module: nn.Module, args: Any, output: Any) -> Any:
    """A unit's output tensors that are views of a tensor outside autograd, made plain aliases of it.

    A tensor-parallel layer's local output (`DTensor.to_local()`, e.g. the logits of a head with a gathered output
    at the end of the model) is such a view: autograd created it inside a custom Function, and refuses any in-place
    op on it. FSDP warns about every view a unit returns ("will silently drop the pre-backward hook"), which cannot
    happen to this kind, on every step of every rank. As a plain alias FSDP's hook stays on it even through an
    in-place op. Views of tensors that autograd tracks are left as they are, and FSDP's warning about them stands.
    """
    return _map_tensors(output, _alias_if_detached_view)


def _alias_if_detached_view(tensor: torch.Tensor) -> torch.Tensor:
    base = view_base(tensor)
    if tensor.requires_grad and base is not None and base.grad_fn is None and not base.requires_grad:
        return _Alias.apply(tensor)
    return tensor


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`fn` on each tensor of a module output: tensors, tuples and lists, mappings (transformers' `ModelOutput`,
    changed in place, which keeps its attributes in step)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    if isinstance(value, tuple):
        items = [_map_tensors(v, fn) for v in value]
        if all(new is old for new, old in zip(items, value)):
            return value
        return tuple(items) if type(value) is tuple else type(value)(*items)  # a named tuple takes its fields
    if isinstance(value, dict):
        for key, item in value.items():
            new = _map_tensors(item, fn)
            if new is not item:
                value[key] = new
    return value
