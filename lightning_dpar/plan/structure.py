"""What planning reads off the model's structure, once: its repeated blocks, the top-level modules a data-parallel
wrapper wraps, and whether parallelism was applied to it already (by the user's `configure_model`, or by classic
DDP / FSDP1 wrappers that cannot compose)."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_dpar._private_api import is_composable_replicated
from lightning_dpar.helpers import class_name, has_parameters

__all__ = [
    "check_not_wrapped_by_other_parallelism",
    "data_parallel_roots",
    "direct_parameters",
    "has_fully_shard",
    "is_parallelized",
    "module_structure",
    "repeated_blocks",
]

CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def repeated_blocks(root: nn.Module) -> list[str]:
    """The default FSDP / activation-checkpointing units: every child of every `nn.ModuleList` (transformer layers)."""
    return [
        f"{fqn}.{name}" if fqn else name
        for fqn, module in root.named_modules()
        if isinstance(module, nn.ModuleList)
        for name, child in module.named_children()
        if has_parameters(child)
    ]


def module_structure(root: nn.Module) -> tuple:
    """What a plan is computed from, as one comparable value: every module's name and class, and every parameter's
    name, identity (ties), shape and whether it trains. A model whose structure is unchanged has the same plan, so a
    strategy plans it once (`DparStrategy._plan_for`) even when its hooks run before and after the process group."""
    modules = tuple((name, type(module)) for name, module in root.named_modules(remove_duplicate=False))
    parameters = tuple(
        (name, id(p), tuple(p.shape), p.requires_grad) for name, p in root.named_parameters(remove_duplicate=False)
    )
    return modules, parameters


def direct_parameters(root: nn.Module) -> list[str]:
    """Names of parameters registered on `root` itself rather than on a child module."""
    return [name for name, _ in root.named_parameters(recurse=False)]


def data_parallel_roots(root: nn.Module) -> list[str]:
    """Children of the LightningModule that hold parameters: each becomes a top-level wrapped unit.

    A container child (`nn.ModuleList` / `nn.ModuleDict`) has no `forward`, so a wrapper's forward hooks on it would
    never run (`fully_shard` refuses it; `replicate` would silently skip the gradient all-reduce): its items take its
    place, recursively.
    """
    roots: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            fqn = f"{prefix}{name}"
            if not has_parameters(child):
                continue
            if isinstance(child, CONTAINERS):
                if direct_parameters(child):
                    raise ValueError(
                        f"Container {fqn!r} ({class_name(child)}) holds parameters of its own"
                        f" ({direct_parameters(child)}); put them in a module that the model calls."
                    )
                visit(f"{fqn}.", child)
            else:
                roots.append(fqn)

    visit("", root)
    return roots


def is_parallelized(module: nn.Module) -> bool:
    """Whether any parallelism (ours or the user's own `configure_model`) was already applied."""
    return any(isinstance(m, FSDPModule) or is_composable_replicated(m) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters()
    )


def has_fully_shard(module: nn.Module) -> bool:
    return any(isinstance(m, FSDPModule) for m in module.modules())


def check_not_wrapped_by_other_parallelism(module: nn.Module, strategy_name: str) -> None:
    """Refuse modules wrapped in classic (non-composable) DDP or FSDP1: their FQNs and hooks cannot compose."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    for fqn, m in module.named_modules():
        if isinstance(m, (DistributedDataParallel, FullyShardedDataParallel)):
            raise TypeError(
                f"Module {fqn or '<root>'!r} is already wrapped in {class_name(m)}; {strategy_name} applies its"
                " own parallelism. Remove the wrapper from your model (or `configure_model`) and pass the plain"
                " module."
            )
