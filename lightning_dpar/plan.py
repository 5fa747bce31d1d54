"""Parallelism plans as data: which module gets which tensor-parallel style, which blocks become FSDP units and
which get activation checkpointing.

Everything here is validated against the module tree alone, before any process-group work, so a bad plan fails the
same way (and with the same message) in training, on every rank, and in the `plan` dry-run.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

import torch.nn as nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_dpar.helpers import divisors, has_parameters, show_names

if TYPE_CHECKING:
    from lightning_dpar.pipeline.split import PipelineSplit

__all__ = [
    "ModulePlan",
    "ModuleSelector",
    "StyleSpec",
    "TPPlanSpec",
    "TensorParallelSizeError",
    "fqn_matches",
    "parse_tp_plan",
    "repeated_blocks",
    "resolve_activation_checkpointing",
    "resolve_blocks",
    "resolve_tp_plan",
    "select_modules",
    "tensor_parallel_size_fix",
]

StyleSpec = Union[str, ParallelStyle]
#: `{module-name pattern: style}`, or `"auto"`: the plan of the transformers model the LightningModule holds.
TPPlanSpec = Union[Mapping[str, StyleSpec], str]
AUTO = "auto"
ModuleSelector = Union[str, type]

#: Builds a style for one module: a named style can depend on the module (row-wise on an `nn.Embedding` shards the
#: vocabulary and keeps the token ids whole). `None` means "leave this module unsharded".
StyleBuilder = Callable[[nn.Module], ParallelStyle | None]


def rowwise_style(module: nn.Module) -> ParallelStyle:
    """Row-wise: split a Linear's input features, or an Embedding's vocabulary rows with the token ids whole."""
    # An embedding's input is token ids, which cannot be split along a hidden dim: keep them whole (torchtitan's
    # layout for token embeddings); each rank looks up its vocabulary rows and the partial sums are all-reduced.
    return RowwiseParallel(input_layouts=Replicate()) if isinstance(module, nn.Embedding) else RowwiseParallel()


STYLE_NAMES: dict[str, StyleBuilder] = {
    "colwise": lambda module: ColwiseParallel(),
    "rowwise": rowwise_style,
    "sequence_parallel": lambda module: SequenceParallel(),
}


@dataclass(frozen=True)
class NamedStyle:
    """A style given by name (ours, or a `transformers` style name): built per module when the plan is resolved."""

    name: str
    build: StyleBuilder

    def __repr__(self) -> str:
        return repr(self.name)


PlanStyle = Union[NamedStyle, ParallelStyle]

#: Styles that shard a module's weight, the module types whose weight layout they understand, and for each type the
#: weight dim that is split (column-wise splits the output features, row-wise the input features / vocabulary).
_WEIGHT_SHARDING_STYLES: dict[type[ParallelStyle], dict[type[nn.Module], tuple[int, str]]] = {
    ColwiseParallel: {nn.Linear: (0, "out_features"), nn.Embedding: (1, "embedding_dim")},
    RowwiseParallel: {nn.Linear: (1, "in_features"), nn.Embedding: (0, "num_embeddings")},
}


def parse_style(pattern: str, spec: StyleSpec) -> PlanStyle:
    """A style from a name (`"colwise"`, `"rowwise"`, `"sequence_parallel"`, or a `transformers` style name such as
    `"colwise_gather_output"`; see `lightning_dpar.hf_plan`) or a `ParallelStyle` instance, used as given."""
    from lightning_dpar.hf_plan import HF_STYLES

    if isinstance(spec, (ParallelStyle, NamedStyle)):
        return spec
    if isinstance(spec, str):
        builder = STYLE_NAMES.get(spec.lower()) or HF_STYLES.get(spec.lower())
        if builder is not None:
            return NamedStyle(spec.lower(), builder)
    raise ValueError(
        f"tp_plan[{pattern!r}] = {spec!r} is not a tensor-parallel style. Use one of"
        f" {sorted({*STYLE_NAMES, *HF_STYLES})} or a `torch.distributed.tensor.parallel.ParallelStyle` instance (in"
        " YAML: a `class_path` entry)."
    )


def parse_tp_plan(plan: TPPlanSpec | None) -> dict[str, PlanStyle] | None:
    """Validate a user plan's keys and styles; `None` stays `None` (no plan from this source)."""
    if plan is None:
        return None
    if not isinstance(plan, Mapping):
        if plan == AUTO:
            raise ValueError(f"tp_plan={AUTO!r} is resolved against the model; this function takes a mapping.")
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


def resolve_tp_plan(
    root: nn.Module, plan: Mapping[str, PlanStyle], tensor_parallel_size: int = 1
) -> dict[str, ParallelStyle]:
    """Expand patterns into concrete module names, checking every pattern matches, every style fits its module and
    `tensor_parallel_size` divides every dimension (and head count) it splits.

    Returns `{fqn: style}` in module order; one module matched by two patterns is an error, not a silent override.
    A named style that means "replicate" (`"replicate"`) leaves its modules out. Pure (no process group), so a bad
    plan fails on every rank before any collective, and in the `plan` dry run, with the same message.
    """
    resolved: dict[str, ParallelStyle] = {}
    matched_by: dict[str, str] = {}
    modules = [(fqn, module) for fqn, module in root.named_modules() if fqn]
    for pattern, spec in plan.items():
        hits = [(fqn, module) for fqn, module in modules if fqn_matches(pattern, fqn)]
        if not hits:
            raise ValueError(
                f"tp_plan pattern {pattern!r} matches no module of {type(root).__name__}. Module names look like"
                f" {show_names(fqn for fqn, _ in modules)}; patterns are relative to the LightningModule."
            )
        for fqn, module in hits:
            if fqn in matched_by:
                raise ValueError(
                    f"Module {fqn!r} is matched by both tp_plan patterns {matched_by[fqn]!r} and {pattern!r};"
                    " make the patterns disjoint."
                )
            matched_by[fqn] = pattern
            style = spec.build(module) if isinstance(spec, NamedStyle) else spec
            if style is None:
                continue
            _check_style_fits(fqn, module, style)
            _check_divisible(fqn, module, style, tensor_parallel_size)
            resolved[fqn] = style
    _check_head_counts(root, resolved, tensor_parallel_size)
    return resolved


def _check_style_fits(fqn: str, module: nn.Module, style: ParallelStyle) -> None:
    for style_type, module_types in _WEIGHT_SHARDING_STYLES.items():
        if type(style) is style_type and not isinstance(module, tuple(module_types)):
            raise ValueError(
                f"tp_plan style {style_type.__name__} cannot shard {fqn!r} ({type(module).__name__}): it supports"
                f" {' and '.join(t.__name__ for t in module_types)} only. Point the pattern at the Linear layers"
                " inside that module (e.g. '<block>.*.fc1') or give a custom ParallelStyle."
            )


def _sharded_dim(module: nn.Module, style: ParallelStyle) -> tuple[str, int] | None:
    """(attribute name, size) of the weight dim `style` splits on `module`; `None` if it splits none we know."""
    for module_type, (dim, attribute) in _WEIGHT_SHARDING_STYLES.get(type(style), {}).items():
        if isinstance(module, module_type):
            return attribute, module.weight.shape[dim]
    return None


class TensorParallelSizeError(ValueError):
    """The tensor-parallel size does not divide a dimension the plan splits (a weight dimension or a head count).
    `valid_sizes`: the sizes that divide it; the strategy adds how to set one (`strategies.base`)."""

    def __init__(self, message: str, valid_sizes: Sequence[int]) -> None:
        super().__init__(message)
        self.valid_sizes = list(valid_sizes)


def tensor_parallel_size_fix(
    strategy_class: str, valid_sizes: Sequence[int], tiles: Callable[[int], bool], other_args: Mapping[str, object]
) -> str:
    """How to set a tensor-parallel size that fits, as Python and as LightningCLI YAML: the largest of
    `valid_sizes` that still `tiles` the world (1, no tensor parallelism, always does), with the strategy's
    `other_args` that must stay (e.g. `pipeline_parallel_size` of `dpar_3d`)."""
    size = max([s for s in valid_sizes if tiles(s)] or [1])
    args = {**other_args, "tensor_parallel_size": size}
    python = ", ".join(f"{name}={value!r}" for name, value in args.items())
    yaml = "".join(f"\n      {name}: {value}" for name, value in args.items())
    return (
        f" For example, {size}: in Python `strategy=lightning_dpar.{strategy_class}({python})`; in a LightningCLI"
        f" config (`python -m lightning_dpar fit --config FILE`):\n\ntrainer:\n  strategy:\n    class_path:"
        f" lightning_dpar.{strategy_class}\n    init_args:{yaml}\n"
    )


def _check_divisible(fqn: str, module: nn.Module, style: ParallelStyle, tensor_parallel_size: int) -> None:
    sharded = _sharded_dim(module, style)
    if sharded is not None and sharded[1] % tensor_parallel_size:
        attribute, size = sharded
        raise TensorParallelSizeError(
            f"`tensor_parallel_size={tensor_parallel_size}` does not divide {attribute}={size} of module {fqn!r},"
            f" which {type(style).__name__} splits across the tensor-parallel ranks. Use a tensor-parallel size among"
            f" {divisors(size)} (for `dpar_2d` the default is the devices of one node), or change the model.",
            divisors(size),
        )


#: Head-count attributes of attention modules and model configs (torch, transformers, LitGPT spellings).
HEAD_COUNT_ATTRIBUTES = ("num_heads", "num_attention_heads", "n_head", "num_key_value_heads", "n_query_groups")


def _check_head_counts(root: nn.Module, resolved: Mapping[str, ParallelStyle], tensor_parallel_size: int) -> None:
    """Column-wise q/k/v projections give each rank `heads / tp` whole heads: the head counts must divide.

    Two sources: a `head_dim` attribute on a parent of a column-wise Linear (its heads are out_features / head_dim),
    and the head counts of the `config` of a module above any tensor-parallel module (transformers, LitGPT).
    """
    if tensor_parallel_size == 1 or not resolved:
        return
    for fqn, style in resolved.items():
        parent_fqn, _, _ = fqn.rpartition(".")
        parent = root.get_submodule(parent_fqn)
        head_dim = getattr(parent, "head_dim", None)
        module = root.get_submodule(fqn)
        keeps_heads_split = isinstance(style, ColwiseParallel) and Replicate() not in style.output_layouts
        if keeps_heads_split and isinstance(module, nn.Linear) and isinstance(head_dim, int):
            heads, rest = divmod(module.out_features, head_dim)
            if not rest and heads % tensor_parallel_size:
                raise TensorParallelSizeError(
                    f"`tensor_parallel_size={tensor_parallel_size}` does not divide the {heads} heads of {fqn!r}"
                    f" (out_features {module.out_features} = {heads} heads x head_dim {head_dim}): each rank must hold"
                    f" whole heads. Use a tensor-parallel size among {divisors(heads)}.",
                    divisors(heads),
                )
    for fqn, module in root.named_modules():
        config = getattr(module, "config", None)
        if config is None or not any(name == fqn or name.startswith(f"{fqn}.") or not fqn for name in resolved):
            continue
        for attribute in HEAD_COUNT_ATTRIBUTES:
            count = getattr(config, attribute, None)
            if isinstance(count, int) and not isinstance(count, bool) and count % tensor_parallel_size:
                raise TensorParallelSizeError(
                    f"`tensor_parallel_size={tensor_parallel_size}` does not divide {attribute}={count} of the"
                    f" {type(module).__name__} at {fqn or '<root>'!r}: column-wise attention projections must give"
                    f" each rank whole heads. Use a tensor-parallel size among {divisors(count)}.",
                    divisors(count),
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
    return type(module).__name__ == selector or fqn_matches(selector, fqn)


def repeated_blocks(root: nn.Module) -> list[str]:
    """The default FSDP / activation-checkpointing units: every child of every `nn.ModuleList` (transformer layers)."""
    return [
        f"{fqn}.{name}" if fqn else name
        for fqn, module in root.named_modules()
        if isinstance(module, nn.ModuleList)
        for name, child in module.named_children()
        if has_parameters(child)
    ]


@dataclass(frozen=True)
class ModulePlan:
    """What will be applied to which module, in application order (TP, activation checkpointing, compile, FSDP).

    `adopted` marks a model the user parallelised in `configure_model`: no TP or activation checkpointing is added.
    With pipeline parallelism, `pipeline` is the split into stages and the other entries name only the modules of
    `pipeline_rank`'s stages (the split is applied first). `tied` lists the parameters reachable under several names
    (tied embeddings, a module shared by several blocks), found on the model before any parallelism: each stays one
    parameter (see `lightning_dpar.ties`).
    """

    tensor_parallel: dict[str, ParallelStyle]
    activation_checkpointing: list[str]
    shard_units: list[str]
    compile_units: list[str] = field(default_factory=list)
    adopted: bool = False
    pipeline: PipelineSplit | None = None
    pipeline_rank: int = 0
    tied: list[tuple[str, ...]] = field(default_factory=list)


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
