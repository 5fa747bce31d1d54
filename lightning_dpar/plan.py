"""Parallelism plans as data: which module gets which tensor-parallel style, which blocks become FSDP units and
which get activation checkpointing.

Everything here is validated against the module tree alone, before any process-group work, so a bad plan fails the
same way (and with the same message) in training, on every rank, and in the `plan` dry-run.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Union

import torch.nn as nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "ModulePlan",
    "ModuleSelector",
    "StyleSpec",
    "TPPlanSpec",
    "fqn_matches",
    "parse_tp_plan",
    "repeated_blocks",
    "resolve_activation_checkpointing",
    "resolve_blocks",
    "resolve_tp_plan",
    "select_modules",
]

StyleSpec = Union[str, ParallelStyle]
TPPlanSpec = Mapping[str, StyleSpec]
ModuleSelector = Union[str, type]

STYLE_NAMES: dict[str, type[ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "sequence_parallel": SequenceParallel,
}

#: Styles that shard a module's weight, and the module types whose weight layout they understand.
_WEIGHT_SHARDING_STYLES: dict[type[ParallelStyle], tuple[type[nn.Module], ...]] = {
    ColwiseParallel: (nn.Linear, nn.Embedding),
    RowwiseParallel: (nn.Linear, nn.Embedding),
}


def parse_style(pattern: str, spec: StyleSpec) -> ParallelStyle:
    """A style object from a name (`"colwise"`, `"rowwise"`, `"sequence_parallel"`) or a `ParallelStyle`."""
    if isinstance(spec, ParallelStyle):
        return spec
    if isinstance(spec, str) and spec.lower() in STYLE_NAMES:
        return STYLE_NAMES[spec.lower()]()
    raise ValueError(
        f"tp_plan[{pattern!r}] = {spec!r} is not a tensor-parallel style. Use one of {sorted(STYLE_NAMES)} or a"
        " `torch.distributed.tensor.parallel.ParallelStyle` instance (in YAML: a `class_path` entry)."
    )


def parse_tp_plan(plan: TPPlanSpec | None) -> dict[str, ParallelStyle] | None:
    """Validate a user plan's keys and styles; `None` stays `None` (no plan from this source)."""
    if plan is None:
        return None
    if not isinstance(plan, Mapping):
        raise TypeError(f"`tp_plan` must map module-name patterns to styles, got {type(plan).__name__}: {plan!r}.")
    parsed = {}
    for pattern, spec in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"tp_plan key {pattern!r} must be a non-empty module-name pattern such as 'layers.*.fc1'.")
        parsed[pattern] = parse_style(pattern, spec)
    return parsed


def fqn_matches(pattern: str, fqn: str) -> bool:
    """Glob match per dotted segment, as `parallelize_module` does: `layers.*.net[1]` matches `layers.0.net1`."""
    pattern_atoms, fqn_atoms = pattern.split("."), fqn.split(".")
    return len(pattern_atoms) == len(fqn_atoms) and all(
        fnmatch.fnmatchcase(atom, p) for p, atom in zip(pattern_atoms, fqn_atoms)
    )


def resolve_tp_plan(root: nn.Module, plan: Mapping[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """Expand patterns into concrete module names, checking every pattern matches and every style fits its module.

    Returns `{fqn: style}` in module order; one module matched by two patterns is an error, not a silent override.
    """
    resolved: dict[str, ParallelStyle] = {}
    matched_by: dict[str, str] = {}
    modules = [(fqn, module) for fqn, module in root.named_modules() if fqn]
    for pattern, style in plan.items():
        hits = [(fqn, module) for fqn, module in modules if fqn_matches(pattern, fqn)]
        if not hits:
            raise ValueError(
                f"tp_plan pattern {pattern!r} matches no module of {type(root).__name__}. Module names look like"
                f" {_examples(fqn for fqn, _ in modules)}; patterns are relative to the LightningModule."
            )
        for fqn, module in hits:
            if fqn in matched_by:
                raise ValueError(
                    f"Module {fqn!r} is matched by both tp_plan patterns {matched_by[fqn]!r} and {pattern!r};"
                    " make the patterns disjoint."
                )
            _check_style_fits(fqn, module, style)
            matched_by[fqn] = pattern
            resolved[fqn] = style
    return resolved


def _check_style_fits(fqn: str, module: nn.Module, style: ParallelStyle) -> None:
    for style_type, module_types in _WEIGHT_SHARDING_STYLES.items():
        if type(style) is style_type and not isinstance(module, module_types):
            raise ValueError(
                f"tp_plan style {style_type.__name__} cannot shard {fqn!r} ({type(module).__name__}): it supports"
                f" {' and '.join(t.__name__ for t in module_types)} only. Point the pattern at the Linear layers"
                " inside that module (e.g. '<block>.*.fc1') or give a custom ParallelStyle."
            )


def _examples(names: Iterable[str], limit: int = 6) -> str:
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}]"


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
                f" module-name glob (names look like {_examples(fqn for fqn, _ in modules)})."
            )
        chosen.extend(fqn for fqn in hits if fqn not in chosen)
    order = {fqn: i for i, (fqn, _) in enumerate(modules)}
    return sorted(chosen, key=order.__getitem__)


def _selector_matches(selector: ModuleSelector, fqn: str, module: nn.Module) -> bool:
    if isinstance(selector, type):
        return isinstance(module, selector)
    return type(module).__name__ == selector or fqn_matches(selector, fqn)


def repeated_blocks(root: nn.Module) -> list[str]:
    """The default FSDP / activation-checkpointing units: every child of every `nn.ModuleList` (transformer layers)."""
    return [
        f"{fqn}.{name}" if fqn else name
        for fqn, module in root.named_modules()
        if isinstance(module, nn.ModuleList)
        for name, child in module.named_children()
        if any(True for _ in child.parameters())
    ]


@dataclass(frozen=True)
class ModulePlan:
    """What will be applied to which module, in application order (TP, activation checkpointing, FSDP)."""

    tensor_parallel: dict[str, ParallelStyle]
    activation_checkpointing: list[str]
    shard_units: list[str]


def resolve_blocks(root: nn.Module, spec: Sequence[ModuleSelector] | None, what: str) -> list[str]:
    """`None` means the default repeated blocks; an explicit list is matched with `select_modules`."""
    return repeated_blocks(root) if spec is None else select_modules(root, spec, what)


def resolve_activation_checkpointing(
    root: nn.Module, spec: bool | Sequence[ModuleSelector], shard_units: list[str]
) -> list[str]:
    """`True` checkpoints each sharded block (or the repeated blocks when nothing is sharded); a list selects."""
    if spec is False or spec is None:
        return []
    if spec is True:
        return shard_units or repeated_blocks(root)
    return select_modules(root, spec, "activation_checkpointing")
