"""Buffers that are not sharded (BatchNorm's running statistics, counters) kept as Lightning's DDP keeps them.

DDP broadcasts rank 0's buffers to its peers before a forward that follows a training forward with gradient sync
(and before the first forward): ranks then differ only by their last step's own update, and every rank evaluates,
and every checkpoint holds, rank 0's statistics. Composable `replicate` builds its DDP over the parameters only,
so it broadcasts no buffers, and FSDP2 never does: without this, each rank's buffers drift on their own batches.

`BufferSync` follows DDP's schedule exactly (see `torch.nn.parallel.DistributedDataParallel._pre_forward` and
`_post_forward`), over the data-parallel group only: tensor-parallel peers see the same batches and update their
buffers alike, and each pipeline stage syncs its own. Sharded buffers (DTensors) are left alone. One broadcast per
buffer dtype, of the buffers flattened together, and none when the group has one rank or the model no buffers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

__all__ = [
    "BufferSync",
    "broadcast_from_first",
]


def broadcast_from_first(tensors: Iterable[Tensor], group: dist.ProcessGroup) -> None:
    """Overwrite `tensors` in place with the group's first rank's, one broadcast per dtype (flattened together)."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    with torch.no_grad():
        for same_dtype in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in same_dtype])
            dist.broadcast(flat, group=group, group_src=0)
            for tensor, synced in zip(same_dtype, flat.split([t.numel() for t in same_dtype])):
                tensor.copy_(synced.view_as(tensor))


class BufferSync:
    """DDP's buffer broadcast for a model wrapped with composable APIs: call `before_forward` before each step's
    forward (training, validation, test, predict) and `after_forward` after it.

    The buffers are the model's when the strategy wraps it, as DDP's are the module's when DDP wraps it: their
    owners and names are found once, and each buffer is read from its owner at every sync, so a module that
    reassigns one (`self.running_mean = ...`) has the new tensor synced. A model without buffers costs one check
    per step."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None) -> None:
        self._group = group if group is not None and dist.get_world_size(group) > 1 else None
        self._owners = [_owner(module, name) for name, _ in module.named_buffers()]
        #: DDP's `require_forward_param_sync`: True after a forward with gradients and gradient sync (and at first).
        self._pending = True

    def _local_buffers(self) -> list[tuple[str, Tensor]]:
        """The buffers each rank holds whole (not DTensors), by name, read from their owners now."""
        found = ((name, getattr(owner, attribute)) for name, owner, attribute in self._owners)
        return [(name, b) for name, b in found if isinstance(b, Tensor) and not isinstance(b, DTensor)]

    def before_forward(self) -> None:
        """Broadcast the data-parallel group's first rank's buffers, if a synced training forward ran since."""
        if self._pending and self._group is not None and self._owners:
            buffers = [b for _, b in self._local_buffers()]
            if buffers:
                broadcast_from_first(buffers, self._group)
        self._pending = False

    def after_forward(self, synced_training: bool) -> None:
        """`synced_training`: the forward recorded gradients that will be synchronised (not a `no_sync` micro-batch
        of gradient accumulation, not evaluation)."""
        self._pending = synced_training

    def first_rank_copies(self, state: dict[str, object]) -> dict[str, object]:
        """`state` (a model state dict) with its unsharded buffers replaced by copies of the group's first rank's,
        so a checkpoint holds rank 0's buffers, as DDP's does, whichever rank writes them; the module's own buffers
        are not changed (DDP's ranks keep their own until the next forward)."""
        if self._group is None:
            return state
        copies = {name: b.detach().clone() for name, b in self._local_buffers() if name in state}
        if copies:
            broadcast_from_first(copies.values(), self._group)
        return {**state, **copies}


def _owner(module: nn.Module, name: str) -> tuple[str, nn.Module, str]:
    """`name` (a buffer's dotted name in `module`) with the module that owns it and its attribute name there."""
    path, _, attribute = name.rpartition(".")
    return name, module.get_submodule(path), attribute
