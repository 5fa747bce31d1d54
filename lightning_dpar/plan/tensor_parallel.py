"""Tensor-parallel plans resolved against the model: module-name patterns expanded to concrete modules, each style
checked to fit its module, and the tensor-parallel size checked to divide every dimension and head count it splits.

Validated against the module tree alone, before any process-group work, so a bad plan fails the same way (and with
the same message) in training, on every rank, and in the `plan` dry run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch.nn as nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_dpar.helpers import class_name, divisors, show_names
from lightning_dpar.plan.selectors import fqn_matches
from lightning_dpar.plan.styles import NamedStyle, PlanStyle

__all__ = [
    "HEAD_COUNT_ATTRIBUTES",
    "TensorParallelSizeError",
    "resolve_tp_plan",
    "tensor_parallel_size_fix",
]

#: Styles that shard a module's weight, the module types whose weight layout they understand, and for each type the
#: weight dim that is split (column-wise splits the output features, row-wise the input features / vocabulary).
_WEIGHT_SHARDING_STYLES: dict[type[ParallelStyle], dict[type[nn.Module], tuple[int, str]]] = {
    ColwiseParallel: {nn.Linear: (0, "out_features"), nn.Embedding: (1, "embedding_dim")},
    RowwiseParallel: {nn.Linear: (1, "in_features"), nn.Embedding: (0, "num_embeddings")},
}


def resolve_tp_plan(
    root: nn.Module,
    plan: Mapping[str, PlanStyle],
    tensor_parallel_size: int = 1,
    uneven_gathered_columns: bool = False,
) -> dict[str, ParallelStyle]:
    """Expand patterns into concrete module names, checking every pattern matches, every style fits its module and
    `tensor_parallel_size` divides every dimension (and head count) it splits.

    Returns `{fqn: style}` pattern by pattern in the plan's order, each pattern's modules in module order; one module
    matched by two patterns is an error, not a silent override.
    A named style that means "replicate" (`"replicate"`) leaves its modules out. Pure (no process group), so a bad
    plan fails on every rank before any collective, and in the `plan` dry run, with the same message.

    `uneven_gathered_columns` lets a column-wise style whose output is gathered whole split a dimension the size
    does not divide (loss parallel's output layer: an uneven vocabulary is sharded unevenly, exactly).
    """
    resolved: dict[str, ParallelStyle] = {}
    matched_by: dict[str, str] = {}
    modules = [(fqn, module) for fqn, module in root.named_modules() if fqn]
    for pattern, spec in plan.items():
        hits = [(fqn, module) for fqn, module in modules if fqn_matches(pattern, fqn)]
        if not hits:
            raise ValueError(
                f"tp_plan pattern {pattern!r} matches no module of {class_name(root)}. Module names look like"
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
            _check_not_fused_by_global_heads(root, fqn, module, style, tensor_parallel_size)
            gathered = type(style) is ColwiseParallel and Replicate() in style.output_layouts
            if not (uneven_gathered_columns and gathered):
                _check_divisible(fqn, module, style, tensor_parallel_size)
            resolved[fqn] = style
    _check_head_counts(root, resolved, tensor_parallel_size)
    return resolved


def _check_style_fits(fqn: str, module: nn.Module, style: ParallelStyle) -> None:
    for style_type, module_types in _WEIGHT_SHARDING_STYLES.items():
        if type(style) is style_type and not isinstance(module, tuple(module_types)):
            raise ValueError(
                f"tp_plan style {style_type.__name__} cannot shard {fqn!r} ({class_name(module)}): it supports"
                f" {' and '.join(class_name(t) for t in module_types)} only. Point the pattern at the Linear layers"
                " inside that module (e.g. '<block>.*.fc1') or give a custom ParallelStyle."
            )


def _check_not_fused_by_global_heads(
    root: nn.Module, fqn: str, module: nn.Module, style: ParallelStyle, tensor_parallel_size: int
) -> None:
    """Refuse a column-wise split of a fused q/k/v projection that its attention splits by the model's global head
    counts: LitGPT's `qkv`, found by its name and shape (out_features = (n_head + 2 n_query_groups) x head_size),
    split into q, k and v with `config.n_head` and `config.n_query_groups` in every forward. Its contiguous column
    shards would hold rows of q, k and v mixed, and the forward would still reshape by the global counts: it cannot
    run, or would compute wrong attention."""
    if tensor_parallel_size == 1 or not isinstance(module, nn.Linear) or not isinstance(style, ColwiseParallel):
        return
    parent_fqn, _, _ = fqn.rpartition(".")
    parent = root.get_submodule(parent_fqn)
    if getattr(parent, "qkv", None) is not module:  # LitGPT's name; an MLP of the same width is not it
        return
    config = getattr(parent, "config", None)
    n_head, groups, head_size = (getattr(config, name, None) for name in ("n_head", "n_query_groups", "head_size"))
    if not all(isinstance(n, int) for n in (n_head, groups, head_size)):
        return
    if module.out_features != (n_head + 2 * groups) * head_size:  # type: ignore[operator]
        return
    raise ValueError(
        f"tp_plan splits {fqn!r} column-wise, but it is a fused q/k/v projection ({n_head} query heads, {groups}"
        f" key/value groups of size {head_size}) that {class_name(parent)} splits by the"
        " global head counts in every forward (LitGPT's `qkv`): a column shard would hold rows of q, k and v mixed,"
        " not whole heads. Leave attention whole and split the MLP only (LitGPT: `transformer.h.*.mlp.fc_[12]`"
        " colwise, `transformer.h.*.mlp.proj` rowwise), or train the attention tensor-parallel with a model whose"
        " q, k and v are separate Linear layers."
    )


def _sharded_dim(module: nn.Module, style: ParallelStyle) -> tuple[str, int] | None:
    """(attribute name, size) of the weight dim `style` splits on `module`; `None` if it splits none we know."""
    for module_type, (dim, attribute) in _WEIGHT_SHARDING_STYLES.get(type(style), {}).items():
        if isinstance(module, module_type):
            return attribute, module.weight.shape[dim]
    return None


class TensorParallelSizeError(ValueError):
    """The tensor-parallel size does not divide a dimension the plan splits (a weight dimension or a head count).
    `valid_sizes`: the sizes that divide it; the planner adds how to set one for the strategy (`plan.planner`)."""

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
                    f" {class_name(module)} at {fqn or '<root>'!r}: column-wise attention projections must give"
                    f" each rank whole heads. Use a tensor-parallel size among {divisors(count)}.",
                    divisors(count),
                )
