"""Fabric's objects mapped onto the Trainer's: a `fabric.save`/`fabric.load` state (`{"model": ..., "optimizer":
..., "step": n}`) split into the one model, its optimizers and the rest, which the checkpoint manager writes in the
Trainer's layout (`state_dict`, `optimizer_states`, the rest at the top level) so the two front doors read each
other's checkpoints; and an optimizer built on a model's parameters before the model was parallelised re-pointed at
the parallel parameters (`fabric.setup(model, optimizer)`). Pure: no collective."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.optim import Optimizer

__all__ = ["FabricState", "rebind_optimizer", "split_state"]


@dataclass
class FabricState:
    """A Fabric state split: the model (and its key), the optimizers in the state's order (with their keys), and
    every other key."""

    model_key: str
    model: nn.Module
    optimizers: list[tuple[str, Optimizer]] = field(default_factory=list)
    rest: dict[str, Any] = field(default_factory=dict)


def split_state(state: Mapping[str, Any], strategy: str) -> FabricState:
    """Split a `fabric.save`/`fabric.load` state; exactly one model (the one `fabric.setup` parallelised), since a
    checkpoint holds one model's shards, as a Trainer checkpoint does."""
    models = [(key, value) for key, value in state.items() if isinstance(value, nn.Module)]
    if len(models) != 1:
        raise ValueError(
            f"`{strategy}` saves and loads one model per checkpoint (the Trainer's layout), but the state has"
            f" {len(models)} modules: {[key for key, _ in models]}. Pass `{{'model': model, 'optimizer': optimizer,"
            " ...}}` with the model set up by `fabric.setup`, and save other models to other paths."
        )
    optimizers = [(key, value) for key, value in state.items() if isinstance(value, Optimizer)]
    taken = {models[0][0], *(key for key, _ in optimizers)}
    rest = {key: value for key, value in state.items() if key not in taken}
    return FabricState(models[0][0], models[0][1], optimizers, rest)


def rebind_optimizer(optimizer: Optimizer, names: Mapping[int, str], parallel: Mapping[str, nn.Parameter]) -> None:
    """Point `optimizer`'s parameter groups at the parallel model's parameters: `names` maps the id of each parameter
    before parallelisation to its name, `parallel` each name to the parameter that replaced it (FSDP and tensor
    parallelism replace parameters by DTensors of the same name). The optimizer must not have taken a step yet: its
    state would be for the whole tensors."""
    if optimizer.state:
        raise ValueError(
            f"The {type(optimizer).__name__} passed to `fabric.setup(model, optimizer)` already holds state (it took a"
            " step); it cannot be moved onto the parallel model's shards. Create the optimizer anew, or set up the"
            " model first (`model = fabric.setup(model)`), then create the optimizer on `model.parameters()` and set"
            " it up with `fabric.setup_optimizers(optimizer)`."
        )
    for group in optimizer.param_groups:
        rebound = []
        for parameter in group["params"]:
            name = names.get(id(parameter))
            if name is None or name not in parallel:
                raise ValueError(
                    f"The {type(optimizer).__name__} passed to `fabric.setup(model, optimizer)` holds a parameter of"
                    f" shape {tuple(parameter.shape)} that is not the model's"
                    f"{'' if name is None else f' (its name {name!r} is gone after parallelisation)'}. Build the"
                    " optimizer on `model.parameters()` of the model you set up."
                )
            rebound.append(parallel[name])
        group["params"] = rebound
