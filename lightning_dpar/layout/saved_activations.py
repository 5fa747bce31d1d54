"""Activations counted, not guessed: the bytes autograd saves for backward in one training step of the model, on
meta tensors (no memory, no compute), split into the repeated blocks' share and the rest.

`measure_saved(module, batch_size, seq_len)` runs the LightningModule's own `training_step` on a meta batch of token
ids (`batch_size x (seq_len + 1)`: models that predict the next token cut one off) inside
`torch.autograd.graph.saved_tensors_hooks`, counting each saved tensor once (by identity) and leaving out the
parameters and views of them (counted as parameters already). Forward hooks on the longest `nn.ModuleList`'s
children attribute what is saved inside each block. When the step cannot run on meta tensors (a model that needs
real data, a batch that is not token ids), `None`: the cost model then uses the formula of `layout.activations`.

`SavedActivations.per_rank(...)` scales the count to a layout, with the same rules as the formula: the microbatch's
share of the batch, the blocks of one pipeline stage and the microbatches its schedule keeps in flight, tensor
parallelism dividing a block's activations as Korthikanti et al.'s `(5 + 12/t) / 17`, and activation checkpointing
keeping each block's input (`s*b*h*e`) plus one block recomputed whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lightning_dpar._private_api import view_base

__all__ = ["SavedActivations", "measure_saved"]


@dataclass(frozen=True)
class SavedActivations:
    """Bytes saved for backward by one step on `batch_size` sequences: in each block (the largest), their sum, and
    outside the blocks (embeddings, head, loss)."""

    batch_size: int
    largest_block: int
    blocks: int
    rest: int

    def per_rank(
        self,
        *,
        layers: int,
        hidden: int,
        seq_len: int,
        microbatch_size: int,
        element_size: int,
        tensor_parallel: int = 1,
        pipeline: int = 1,
        microbatches: int = 1,
        schedule: str | None = None,
        checkpointing: bool = False,
    ) -> int:
        """Peak activation bytes of one rank under a layout (see the module docstring)."""
        share = microbatch_size / self.batch_size
        tp = (5 + 12 / tensor_parallel) / 17
        stage_layers = -(-layers // pipeline)
        per_block = self.blocks / max(layers, 1) * share * tp
        in_flight = 1 if schedule is None else microbatches if schedule == "GPipe" else min(microbatches, pipeline)
        if checkpointing:
            kept = stage_layers * seq_len * microbatch_size * hidden * element_size
            recompute = self.largest_block * share * tp
        else:
            kept, recompute = stage_layers * per_block, 0.0
        rest = self.rest * share * (microbatches if schedule == "GPipe" else 1)
        return int(in_flight * kept + recompute + rest)


def _blocks(module: nn.Module) -> list[nn.Module]:
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def measure_saved(module: nn.Module, batch_size: int, seq_len: int, vocab: int) -> SavedActivations | None:
    """What one `training_step` of `module` (a meta-device LightningModule) saves for backward; `None` if the step
    cannot run on a meta batch of token ids."""
    step = getattr(module, "training_step", None)
    if step is None or any(not p.is_meta for p in module.parameters()):
        return None
    params = {id(p) for p in module.parameters()}
    seen: set[int] = set()
    current: list[int] = []
    inside: dict[int, int] = {}
    outside = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        base = view_base(tensor)
        base = base if base is not None else tensor
        if id(tensor) in seen or id(base) in params or id(tensor) in params:
            return tensor
        seen.add(id(tensor))
        size = tensor.numel() * tensor.element_size()
        if current:
            inside[current[-1]] = inside.get(current[-1], 0) + size
        else:
            outside[0] += size
        return tensor

    def enter(index: int) -> Callable[..., None]:
        def hook(*_: object) -> None:
            current.append(index)

        return hook

    def leave(*_: object) -> None:  # returns None: a forward hook's return value would replace the output
        current.pop()

    handles = []
    for index, block in enumerate(_blocks(module)):
        handles.append(block.register_forward_pre_hook(enter(index)))
        handles.append(block.register_forward_hook(leave))
    batch = torch.zeros(batch_size, seq_len + 1, dtype=torch.long, device="meta").clamp_(max=max(vocab - 1, 0))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            step(batch, 0)
    except Exception:  # any model that cannot step on meta token ids: the formula stands in
        return None
    finally:
        for handle in handles:
            handle.remove()
    if not inside:
        return None
    return SavedActivations(batch_size, max(inside.values()), sum(inside.values()), outside[0])
