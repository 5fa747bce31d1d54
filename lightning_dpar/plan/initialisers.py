"""Which function initialises each meta-device module's own tensors, and the refusal of a meta model that nothing
would initialise: facts about the model the planner checks before any collective and `parallel.materialize` uses
when it fills the shards (see its docstring for the order and why it reproduces one process's values)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch import nn

from lightning_dpar._private_api import transformers_module_initialiser
from lightning_dpar.helpers import class_name, is_transformers_model

__all__ = ["Initialiser", "check_initialisable", "initialisers", "own_meta_tensors", "post_order"]

Initialiser = Callable[[nn.Module], None]


def post_order(module: nn.Module) -> Iterator[nn.Module]:
    """Children before parents, the order of `nn.Module.apply` and transformers' `initialize_weights`."""
    for child in module.children():
        yield from post_order(child)
    yield module


def own_meta_tensors(module: nn.Module) -> list[str]:
    tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
    return [name for name, tensor in tensors if tensor.is_meta]


def initialisers(root: nn.Module) -> dict[nn.Module, Initialiser | None]:
    """For every module with meta tensors, the function that initialises its own tensors (`None`: none found)."""
    found: dict[nn.Module, Initialiser | None] = {}

    def visit(module: nn.Module, owner: nn.Module | None) -> None:
        owner = module if is_transformers_model(module) else owner
        for child in module.children():
            visit(child, owner)
        if not own_meta_tensors(module):
            return
        if owner is not None:
            found[module] = transformers_module_initialiser(owner)
        elif callable(getattr(module, "reset_parameters", None)):
            found[module] = lambda m: m.reset_parameters()
        else:
            found[module] = None

    visit(root, None)
    return found


def check_initialisable(root: nn.Module, found: dict[nn.Module, Initialiser | None] | None = None) -> None:
    """Refuse a meta model with tensors that nothing would initialise (they would hold garbage); `found`: its
    `initialisers`, when computed already."""
    missing = {
        f"{class_name(module)} ({', '.join(own_meta_tensors(module))})"
        for module, init in (initialisers(root) if found is None else found).items()
        if init is None
    }
    if missing:
        raise TypeError(
            f"Modules {sorted(missing)} were created on the meta device, but nothing can initialise their tensors:"
            " they define no `reset_parameters()` and sit in no transformers `PreTrainedModel` (whose `_init_weights`"
            " would). Implement `reset_parameters()` (it must also recompute non-persistent buffers), or build the"
            " model without `empty_init` / the meta device."
        )
