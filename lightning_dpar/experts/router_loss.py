"""The router's load-balancing loss of a transformers MoE model over the global batch, as one process computes it.

transformers' MoE models (`output_router_logits=True`) add `router_aux_loss_coef * load_balancing_loss_func(...)`
to their loss. That loss is no average over tokens: it is `num_experts * sum_e f_e * P_e`, the product of two
averages over the batch (the share of routing choices that went to expert `e`, and `e`'s mean router probability).
Computed on each data-parallel rank's own batch and averaged over ranks, it is a mean of products, not the product
of the global means one process computes; Lightning's DDP, Accelerate and torchtitan's transformers path all train
with that per-rank loss.

While a step runs, `GlobalRouterLoss` makes the model's own `load_balancing_loss_func` see the router logits (and
attention mask) of every data-parallel rank: all-gathered in rank order, with this rank's own logits kept in the
autograd graph. Every rank then computes transformers' own loss of the global batch, the one-process value, and
its gradient reaches this rank's logits multiplied by the data-parallel size, because the data-parallel wrappers
average gradients over the ranks: the sum over ranks is the one-process gradient. The cost is one all-gather of
`layers x tokens x experts` router logits per step.

transformers calls the function by its module-level name, so it is replaced there for the duration of each step
(and put back after): the only place its inputs can be reached. Models without `output_router_logits`, and a single
data-parallel rank, are left alone.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Generator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_dpar.helpers import transformers_models

__all__ = ["GlobalRouterLoss", "gather_rows"]

LOSS_FUNCTION = "load_balancing_loss_func"


def gather_rows(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's `local` concatenated along dim 0 in rank order (rows may differ in number); this rank's rows are
    `local` itself, so gradients flow into them and into nothing else."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = torch.tensor([local.shape[0]], device=local.device)
    all_sizes = [torch.empty_like(sizes) for _ in range(world)]
    dist.all_gather(all_sizes, sizes, group=group)
    counts = [int(size.item()) for size in all_sizes]
    padded = local.detach().new_zeros((max(counts), *local.shape[1:]))
    padded[: local.shape[0]] = local.detach()
    pieces = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(pieces, padded.contiguous(), group=group)
    rows = [piece[:count] for piece, count in zip(pieces, counts)]
    rows[rank] = local
    return torch.cat(rows)


def _modeling_module(model: nn.Module) -> ModuleType | None:
    """The module defining the model's class and its loss function (the class may be a wrapper's subclass:
    `fully_shard` makes `FSDP<Class>`)."""
    for cls in type(model).__mro__:
        module = sys.modules.get(cls.__module__)
        if callable(getattr(module, LOSS_FUNCTION, None)):
            return module
    return None


class GlobalRouterLoss:
    """The load-balancing loss of every transformers MoE model in a module, over the data-parallel group's global
    batch (see the module docstring). `active()` is a no-op when there is nothing to change."""

    def __init__(self, root: nn.Module, group: dist.ProcessGroup | None) -> None:
        self._group = group
        self._modules: list[ModuleType] = []
        if group is None or dist.get_world_size(group) == 1:
            return
        for _, model in transformers_models(root):
            module = _modeling_module(model)
            if getattr(model.config, "output_router_logits", False) and module is not None:
                if module not in self._modules:
                    self._modules.append(module)

    @property
    def applies(self) -> bool:
        return bool(self._modules)

    @contextmanager
    def active(self) -> Generator[None, None, None]:
        """While open, each model's loss function computes the global batch's loss."""
        originals = {module: getattr(module, LOSS_FUNCTION) for module in self._modules}
        try:
            for module, original in originals.items():
                setattr(module, LOSS_FUNCTION, self._global(original))
            yield
        finally:
            for module, original in originals.items():
                setattr(module, LOSS_FUNCTION, original)

    def _global(self, original: Callable[..., Any]) -> Callable[..., Any]:
        group = self._group
        assert group is not None

        def global_loss(gate_logits: Any, num_experts: Any = None, top_k: Any = 2, attention_mask: Any = None) -> Any:
            if gate_logits is None or not isinstance(gate_logits, tuple) or not gate_logits:
                return original(gate_logits, num_experts, top_k, attention_mask)
            layers = torch.stack([logits.reshape(-1, logits.shape[-1]) for logits in gate_logits], dim=1)
            gathered = gather_rows(layers, group)  # [global tokens, layers, experts]
            mask = None
            if attention_mask is not None:
                mask = gather_rows(attention_mask.reshape(-1, 1).to(layers.device), group).reshape(1, -1)
            loss = original(tuple(gathered.unbind(dim=1)), num_experts, top_k, mask)
            scale = dist.get_world_size(group)
            return loss.detach() + scale * (loss - loss.detach())  # the global value; the gradient x ranks

        return global_loss
