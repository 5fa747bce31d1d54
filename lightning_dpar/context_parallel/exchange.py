"""The collectives of context parallelism, as autograd functions over public `torch.distributed` calls (gloo runs
them as well as NCCL).

- `split_sequence` / `gather_sequence`: the hidden states enter the model's repeated blocks whole on every
  context-parallel rank (the embedding ran on the whole sequence), each rank keeps its head-tail part, and the last
  block's output is gathered whole again for the head and the loss. Every rank then computes the same loss, and the
  gradient reaching the blocks is the same whole tensor on every rank.
- `gather_key_value`: each attention's keys and values, all-gathered along the sequence and put in global order.
  Its backward reduce-scatters the key/value gradients: each rank's keys were used by every rank's queries.

Why the factor `size`. FSDP averages gradients over its shard dim, which includes the context-parallel ranks. The
parameters outside the blocks (embedding, head) get the same whole gradient on every context-parallel rank, so the
average is right for them. A block parameter's gradient on one rank covers only that rank's tokens: the true
gradient is the sum over the context-parallel ranks, which the average divides by `size`. So the gradient entering
the blocks from `gather_sequence` is multiplied by `size`, and the gradient leaving them through `split_sequence` is
divided by it again (after gathering it whole), which leaves every gradient outside the blocks exact.

`group=None` simulates one rank of the exchange in one process (the activation estimate traces it on fake tensors):
each collective allocates what it would allocate, with this rank's tensor standing in for the others'.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd import Function

from lightning_dpar.context_parallel.layout import HeadTailLayout

__all__ = ["ExchangeCounter", "gather_key_value", "gather_sequence", "split_sequence"]


class ExchangeCounter:
    """Bytes this rank sent in each direction of the key/value exchange (for the measured table in the docs)."""

    def __init__(self) -> None:
        self.forward_bytes = 0
        self.backward_bytes = 0

    def reset(self) -> None:
        self.forward_bytes = self.backward_bytes = 0


def _all_gather(tensor: Tensor, group: dist.ProcessGroup | None, size: int) -> list[Tensor]:
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(size)]
    if group is None:  # simulated: this rank's part in every slot
        for part in parts:
            part.copy_(tensor)
    else:
        dist.all_gather(parts, tensor, group=group)
    return parts


def _reduce_scatter(pieces: list[Tensor], group: dist.ProcessGroup | None) -> Tensor:
    own = torch.empty_like(pieces[0])
    if group is None:  # simulated
        own.copy_(pieces[0])
    else:
        dist.reduce_scatter(own, pieces, op=dist.ReduceOp.SUM, group=group)
    return own


class _SplitSequence(Function):
    @staticmethod
    def forward(ctx: Any, full: Tensor, dim: int, layout: HeadTailLayout, group: dist.ProcessGroup | None) -> Tensor:
        ctx.dim, ctx.layout, ctx.group = dim, layout, group
        return layout.take(full, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        layout: HeadTailLayout = ctx.layout
        whole = layout.assemble(_all_gather(grad, ctx.group, layout.size), ctx.dim)
        return whole / layout.size, None, None, None


class _GatherSequence(Function):
    @staticmethod
    def forward(ctx: Any, part: Tensor, dim: int, layout: HeadTailLayout, group: dist.ProcessGroup | None) -> Tensor:
        ctx.dim, ctx.layout = dim, layout
        return layout.assemble(_all_gather(part, group, layout.size), dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        layout: HeadTailLayout = ctx.layout
        return layout.take(grad, ctx.dim) * layout.size, None, None, None


class _GatherKeyValue(Function):
    @staticmethod
    def forward(
        ctx: Any, part: Tensor, layout: HeadTailLayout, group: dist.ProcessGroup | None, counter: ExchangeCounter
    ) -> Tensor:
        ctx.layout, ctx.group, ctx.counter = layout, group, counter
        counter.forward_bytes += part.numel() * part.element_size() * (layout.size - 1)
        return layout.assemble(_all_gather(part, group, layout.size), -2)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        layout: HeadTailLayout = ctx.layout
        pieces = [layout.take(grad, -2, rank).contiguous() for rank in range(layout.size)]
        own = _reduce_scatter(pieces, ctx.group)
        ctx.counter.backward_bytes += own.numel() * own.element_size() * (layout.size - 1)
        return own, None, None, None


def split_sequence(full: Tensor, dim: int, layout: HeadTailLayout, group: dist.ProcessGroup | None) -> Tensor:
    """This rank's part of a whole-sequence tensor; its gradient is gathered whole (divided by the size, see the
    module docstring). A tensor that needs no gradient is only indexed."""
    if not full.requires_grad:
        return layout.take(full, dim)
    return _SplitSequence.apply(full, dim, layout, group)


def gather_sequence(part: Tensor, dim: int, layout: HeadTailLayout, group: dist.ProcessGroup | None) -> Tensor:
    """The whole sequence from every rank's part; its gradient is this rank's part times the size."""
    return _GatherSequence.apply(part, dim, layout, group)


def gather_key_value(
    part: Tensor, layout: HeadTailLayout, group: dist.ProcessGroup | None, counter: ExchangeCounter
) -> Tensor:
    """The whole sequence's keys (or values) `[..., seq_len, head_dim]` from every rank's part, in global order."""
    return _GatherKeyValue.apply(part, layout, group, counter)
