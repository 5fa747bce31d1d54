"""Choosing modules by name or class: dotted-glob matching as `parallelize_module` does it, the selectors of
`shard_modules`, `activation_checkpointing` and `ignored_modules`, and the blocks they default to."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Union

import torch.nn as nn

from lightning_dpar.helpers import class_name, show_names
from lightning_dpar.plan.structure import repeated_blocks

__all__ = [
    "ModuleSelector",
    "fqn_matches",
    "pattern_reaches",
    "resolve_activation_checkpointing",
    "resolve_blocks",
    "select_modules",
]

ModuleSelector = Union[str, type]


def fqn_matches(pattern: str, fqn: str) -> bool:
    """Glob match per dotted segment, as `parallelize_module` does: `layers.*.net[1]` matches `layers.0.net1`."""
    pattern_atoms, fqn_atoms = pattern.split("."), fqn.split(".")
    return len(pattern_atoms) == len(fqn_atoms) and all(
        fnmatch.fnmatchcase(atom, p) for p, atom in zip(pattern_atoms, fqn_atoms)
    )


def select_modules(root: nn.Module, selectors: Sequence[ModuleSelector], what: str) -> list[str]:
    """Names of modules matched by class (type or class name) or by FQN glob, in module order.

    A selector that matches nothing is an error: a typo would otherwise silently disable sharding or checkpointing.
    """
    chosen: list[str] = []
    modules = [(fqn, module) for fqn, module in root.named_modules() if fqn]
    for selector in selectors:
        hits = [fqn for fqn, module in modules if _selector_matches(selector, fqn, module)]
        if not hits:
            classes = sorted({type(m).__name__ for _, m in modules})
            raise ValueError(
                f"`{what}` entry {selector!r} matches no module. Give a class name (one of {classes[:12]}) or a"
                f" module-name glob (names look like {show_names(fqn for fqn, _ in modules)})."
            )
        chosen.extend(fqn for fqn in hits if fqn not in chosen)
    order = {fqn: i for i, (fqn, _) in enumerate(modules)}
    return sorted(chosen, key=order.__getitem__)


def _selector_matches(selector: ModuleSelector, fqn: str, module: nn.Module) -> bool:
    if isinstance(selector, type):
        return isinstance(module, selector)
    return selector in (type(module).__name__, class_name(module)) or fqn_matches(selector, fqn)


def resolve_blocks(
    root: nn.Module, spec: Sequence[ModuleSelector] | None, what: str, blocks: Sequence[str] | None = None
) -> list[str]:
    """`None` means the default repeated blocks (`blocks`, when the planner found them already); an explicit list is
    matched with `select_modules`."""
    if spec is None:
        return list(blocks) if blocks is not None else repeated_blocks(root)
    return select_modules(root, spec, what)


def resolve_activation_checkpointing(
    root: nn.Module,
    spec: bool | Sequence[ModuleSelector],
    shard_units: list[str],
    blocks: Sequence[str] | None = None,
) -> list[str]:
    """`True` checkpoints each sharded block (or the repeated blocks, `blocks` when found already, when nothing is
    sharded); a list selects."""
    if spec is False or spec is None:
        return []
    if spec is True:
        return shard_units or (list(blocks) if blocks is not None else repeated_blocks(root))
    return select_modules(root, spec, "activation_checkpointing")


def pattern_reaches(pattern: str, fqns: Sequence[str]) -> bool:
    """Whether a module-name pattern (`layers.*.mlp.experts.gate_up_proj`) names one of `fqns` or something inside
    one: a tensor-parallel entry that expert parallelism replaces."""
    atoms = pattern.split(".")
    return any(
        len(atoms) >= len(fqn.split(".")) and fqn_matches(".".join(atoms[: len(fqn.split("."))]), fqn) for fqn in fqns
    )
