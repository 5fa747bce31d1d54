"""What a live replica group sends a recovering one, and how the recovering group applies it.

A group heals from the rank with the same group rank in a live group: both hold the same shards (the same layout in
every group), so the payload is this rank's local shards only, as plain tensors (a `DTensor` carries its mesh, which
names this group's process groups and cannot travel):

- the parameters and buffers of the model (local shards);
- the optimizer's state (its `DTensor` entries as their local shards, put back on the receiving parameter's mesh)
  and the learning-rate schedulers' state;
- the training position: Lightning's fit-loop progress and the data position of the sampler as they were before the
  batch about to be trained, so the recovering group's loop continues at that batch (as a mid-epoch resume does);
- this rank's RNG streams at the same moment (with `seed_everything` every rank of a data-parallel run draws the
  same stream, so a healed rank continues it);
- torchft's own step counter (sent by torchft itself).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

__all__ = [
    "LOCAL_SHARD_KEY",
    "apply_model_state",
    "apply_optimizer_state",
    "model_state",
    "optimizer_state",
    "payload_bytes",
]

#: Marks a `DTensor` optimizer-state entry sent as its local shard.
LOCAL_SHARD_KEY = "__local_shard__"


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def model_state(module: nn.Module) -> dict[str, Tensor]:
    """This rank's local shards of every parameter and buffer, by name (views: nothing is copied here)."""
    state = {name: _local(p.detach()) for name, p in module.named_parameters()}
    state.update({name: _local(b) for name, b in module.named_buffers() if b is not None})
    return state


def apply_model_state(module: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy a peer's local shards into this rank's parameters and buffers; the names and shapes must match."""
    own = dict(module.named_parameters())
    own.update({name: b for name, b in module.named_buffers() if b is not None})
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or extra:
        raise RuntimeError(
            f"The healing peer's model differs from this one: missing {missing[:5]}, unexpected {extra[:5]}. Every"
            " replica group must build the same model with the same strategy arguments."
        )
    with torch.no_grad():
        for name, target in own.items():
            local = _local(target)
            if local.shape != state[name].shape:
                raise RuntimeError(
                    f"The healing peer's shard of {name!r} has shape {tuple(state[name].shape)}, this rank's"
                    f" {tuple(local.shape)}: every replica group must have the same number of ranks and layout."
                )
            local.copy_(state[name])


def optimizer_state(optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's `state_dict` with every `DTensor` replaced by its local shard (marked for the way back)."""
    state = optimizer.state_dict()
    return {
        "state": {
            index: {key: _pack(value) for key, value in entries.items()} for index, entries in state["state"].items()
        },
        "param_groups": state["param_groups"],
    }


def _pack(value: Any) -> Any:
    if isinstance(value, DTensor):
        return {LOCAL_SHARD_KEY: value.to_local().detach().clone()}
    return value.detach().clone() if isinstance(value, Tensor) else value


def apply_optimizer_state(optimizer: Optimizer, state: dict[str, Any]) -> None:
    """Load a peer's optimizer state: local shards go back on the mesh and placements of the parameter they belong
    to, so the next step updates `DTensor` parameters with `DTensor` state as the peer's does."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    unpacked: dict[int, dict[str, Any]] = {}
    for index, entries in state["state"].items():
        param = params[int(index)]
        unpacked[index] = {key: _unpack(value, param) for key, value in entries.items()}
    optimizer.load_state_dict({"state": unpacked, "param_groups": state["param_groups"]})


def _unpack(value: Any, param: Tensor) -> Any:
    if isinstance(value, dict) and LOCAL_SHARD_KEY in value:
        local = value[LOCAL_SHARD_KEY]
        if not isinstance(param, DTensor):
            raise RuntimeError("The healing peer's optimizer state is sharded but this rank's parameter is not.")
        return DTensor.from_local(
            local.to(param.device),
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    return value


def payload_bytes(payload: object) -> int:
    """Bytes of tensor data in a (nested) payload: what a heal copies for this rank."""
    return sum(t.numel() * t.element_size() for t in _tensors(payload))


def _tensors(value: object) -> Iterable[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
