"""Lightning's weight-averaging callbacks (`WeightAveraging`, `EMAWeightAveraging`, `StochasticWeightAveraging`)
with sharded models: the averaged weights are laid out exactly like the model's.

Why they fail otherwise: both callbacks copy the LightningModule (`deepcopy`) in their `setup` hook, which Lightning
calls before the strategy parallelises the model. The copy keeps whole plain tensors while the model's parameters
become DTensor shards (or, with pipeline parallelism, only this stage's units), so the first update mixes the two
(`aten.copy_.default got mixed torch.Tensor and DTensor`).

What the strategy does instead (`lay_out_averaged_copies`, once the model is parallelised): every parameter and buffer
of each callback's copy becomes a detached clone of the model's tensor of the same name: a DTensor on the same mesh
with the same placements, so each rank holds the average of its own shards only and no rank ever gathers the model.
Entries the model does not hold on this rank (other pipeline stages' units) are dropped, so the copy's parameters
line up one to one with the model's, as the callbacks' positional `zip`s need. The callbacks then run unchanged:
their updates, the swaps around validation and the final copy into the model all operate shard against shard, and
the averaged state they put in a checkpoint is saved sharded like the model (`checkpoint.sharded`).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_dpar._private_api import averaged_copy

__all__ = ["is_weight_averaging", "lay_out_averaged_copies", "lay_out_like"]

WEIGHT_AVERAGING_CALLBACKS = (WeightAveraging, StochasticWeightAveraging)


def is_weight_averaging(callback: Any) -> bool:
    """Whether `callback` is one of Lightning's weight-averaging callbacks (or a subclass)."""
    return isinstance(callback, WEIGHT_AVERAGING_CALLBACKS)


def lay_out_averaged_copies(callbacks: list[Any], model: nn.Module) -> None:
    """Give the averaged copy of every weight-averaging callback in `callbacks` the layout of `model` (the
    parallelised LightningModule). A copy already laid out like it (a second `setup` of the same run) is kept, with
    the averages it holds."""
    for callback in callbacks:
        if is_weight_averaging(callback):
            copy = averaged_copy(callback)
            if copy is not None and copy is not model:
                lay_out_like(copy, model, type(callback).__name__)


def lay_out_like(copy: nn.Module, model: nn.Module, owner: str) -> None:
    """Replace `copy`'s parameters and buffers by clones of `model`'s of the same names (same type, mesh and
    placements); drop those `model` does not hold. Tied tensors stay tied."""
    if _laid_out_like(copy, model):
        return
    sources: dict[str, Tensor] = dict(model.named_parameters(remove_duplicate=False))
    sources.update(model.named_buffers(remove_duplicate=False))
    clones: dict[int, Tensor] = {}  # by the source's identity: one clone per tied tensor

    def clone_of(source: Tensor, like: Tensor) -> Tensor:
        if id(source) not in clones:
            value = source.detach().clone()
            if value.device != like.device:  # the callback's `device` argument (e.g. "cpu")
                value = value.to(like.device)
            clones[id(source)] = nn.Parameter(value, requires_grad=False) if isinstance(like, nn.Parameter) else value
        return clones[id(source)]

    for name, submodule in list(copy.named_modules(remove_duplicate=False)):
        prefix = f"{name}." if name else ""
        own = [*submodule.named_parameters(recurse=False, remove_duplicate=False)]
        own += submodule.named_buffers(recurse=False, remove_duplicate=False)
        for attr, tensor in own:
            source = sources.get(prefix + attr)
            if source is None:
                delattr(submodule, attr)  # held by another pipeline stage
            else:
                setattr(submodule, attr, clone_of(source, tensor))  # a buffer stays (non-)persistent
    if not _laid_out_like(copy, model):
        raise RuntimeError(
            f"{owner}'s averaged copy of the model does not have the parallelised model's parameters and buffers"
            f" after being laid out like it: copy {_names(copy)}, model {_names(model)}. The callback's copy is"
            " taken in its `setup` hook; build the model's layers in `__init__` or `configure_model`, not later."
        )


def _names(module: nn.Module) -> list[str]:
    return [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]


def _layout(tensor: Tensor) -> tuple[Any, ...]:
    """What must match between a tensor and its average: type, global shape, dtype, and a DTensor's mesh and
    placements."""
    placement = (tensor.device_mesh, tensor.placements) if isinstance(tensor, DTensor) else None
    return isinstance(tensor, DTensor), tuple(tensor.shape), tensor.dtype, placement


def _laid_out_like(copy: nn.Module, model: nn.Module) -> bool:
    ours = list(copy.named_parameters()) + list(copy.named_buffers())
    theirs = list(model.named_parameters()) + list(model.named_buffers())
    return [n for n, _ in ours] == [n for n, _ in theirs] and all(
        _layout(a) == _layout(b) for (_, a), (_, b) in zip(ours, theirs)
    )
