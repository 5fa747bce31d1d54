"""Meta-device materialisation, shard by shard: each rank allocates only its own shards, and every parameter and
buffer gets exactly the value the model's own initialiser gives it on a whole model.

A model built on the meta device (`trainer.init_module(empty_init=True)`, `with torch.device("meta")`, or in
`configure_model`) holds no memory; the strategies shard it first and call `materialize_meta_tensors` last. For each
module with meta tensors, in the order `nn.Module.apply` and transformers' `init_weights` visit them (children
before parents):

1. its own parameters and buffers are allocated whole, on CPU, for that module only;
2. its initialiser fills them: the `_init_weights(module)` of the nearest enclosing transformers `PreTrainedModel`
   (which also recomputes rotary `inv_freq` buffers exactly), otherwise the module's `reset_parameters()`;
3. each rank copies its slice into its shard (`distribute_tensor(..., src_data_rank=None)`: no communication).

Tied parameters stay tied (`to_empty` would give each holder its own tensor) and take their first holder's values.

So the random draws happen in the same order and with the same shapes as when the initialiser runs over the whole
model on one process: with the same seed, the sharded model is the whole model, sliced. The peak extra memory is the
largest single module's own tensors (e.g. the token embedding), never the model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_dpar.helpers import class_name
from lightning_dpar.plan.initialisers import (
    Initialiser,
    check_initialisable,
    initialisers,
    own_meta_tensors,
    post_order,
)
from lightning_dpar.plan.ties import TiedGroup, retie, tied_parameters

__all__ = ["materialize_meta_tensors"]


def materialize_meta_tensors(root: nn.Module, device: torch.device, tied: Sequence[TiedGroup] | None = None) -> None:
    """Allocate `root`'s meta tensors on `device` (local shards only) and initialise them as described above.

    `tied`: the plan's tied parameters (`ModulePlan.tied`, found once before any parallelism); looked up on `root`
    when not given. The planner refused a model that nothing would initialise before any collective; the same
    refusal here covers a direct call."""
    found = initialisers(root)
    if not found:
        return
    check_initialisable(root, found)
    meta_names = {module: own_meta_tensors(module) for module in found}
    tied = tied_parameters(root) if tied is None else tied
    root.to_empty(device=device)  # FSDP2 and DTensor allocate each rank's local shard only
    retie(root, tied)  # `to_empty` gives each module holding a tied (non-DTensor) parameter a tensor of its own
    written: set[int] = set()
    with torch.no_grad():
        for module in post_order(root):
            init = found.get(module)
            if init is not None:
                _initialise_whole_then_slice(module, meta_names[module], init, written)


def _unwritten(like: torch.Tensor) -> torch.Tensor:
    whole = torch.empty(like.shape, dtype=like.dtype, device="cpu")
    return whole.fill_(float("nan")) if whole.is_floating_point() else whole


def _initialise_whole_then_slice(module: nn.Module, names: list[str], init: Initialiser, written: set[int]) -> None:
    """Initialise `module`'s own tensors whole and copy each rank's slice in. A tied parameter keeps the value of its
    first holder's initialiser (`written` holds the tensors set already); the later holders' initialisers still run,
    drawing the same random numbers as on the whole model, as transformers' own meta-device path does (every module
    initialised, then `tie_weights`)."""
    sharded = {name: getattr(module, name) for name in names}
    # NaN-filled, so a tensor the initialiser leaves untouched is caught instead of training on garbage.
    whole = {name: _unwritten(t) for name, t in sharded.items()}
    parameters = {name for name, _ in module.named_parameters(recurse=False)}
    try:
        for name, tensor in whole.items():
            value = nn.Parameter(tensor, requires_grad=sharded[name].requires_grad) if name in parameters else tensor
            setattr(module, name, value)
        init(module)
        whole = {name: getattr(module, name).detach() for name in names}  # an initialiser may rebind a buffer
    finally:
        for name, tensor in sharded.items():
            setattr(module, name, tensor)
    unwritten = [name for name, tensor in whole.items() if tensor.is_floating_point() and tensor.isnan().any()]
    if unwritten:
        raise TypeError(
            f"The initialiser of {class_name(module)} left {unwritten} uninitialised after the model was built on"
            " the meta device (e.g. a rotary `inv_freq` buffer that only `__init__` computes; transformers < 5 does"
            " not recompute it). Give the module a `reset_parameters()` that sets them, or build the model without"
            " `empty_init` / the meta device."
        )
    for name, target in sharded.items():
        if id(target) in written:
            continue
        written.add(id(target))
        if isinstance(target, DTensor):
            target.copy_(distribute_tensor(whole[name], target.device_mesh, target.placements, src_data_rank=None))
        else:
            target.copy_(whole[name])
