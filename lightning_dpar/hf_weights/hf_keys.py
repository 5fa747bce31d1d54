"""transformers' checkpoint key renamings: the names a model's weights have in its `save_pretrained` files, which
are not always the names of its parameters.

transformers 5 keeps a conversion mapping per model class: GPT-NeoX's output head is the parameter `lm_head.weight`
but is stored as `embed_out.weight` (every Pythia checkpoint on the Hub, and `save_pretrained` today).
`from_pretrained` renames on load and `save_pretrained` renames back. Loading pretrained weights into shards
(`lightning_dpar.hf_weights.pretrained`) and `consolidate --format hf` (`lightning_dpar.checkpoint.hf_export`) apply the
same
renames, so both see the files as transformers does.

Renames (`WeightRenaming`) are applied here. Of the conversions that merge tensors (`WeightConverter`), the one
mixture-of-experts models use, per-expert tensors stacked into one fused parameter, is read from the same mapping
(`expert_merges`) and applied by `lightning_dpar.experts.keys`; a class whose checkpoints need another conversion keeps
its checkpoint names, and strict loading names the keys that do not fit. Without transformers, or with one older than
5 (no conversion mapping), nothing is renamed or merged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from torch import nn

from lightning_dpar.experts.keys import ExpertMerge

__all__ = ["expert_merges", "library_class_name", "loaded_names", "model_expert_merges", "name_in_files", "saved_names"]


def library_class_name(model: nn.Module) -> str:
    """The transformers class of `model` (FSDP2 and `replicate` swap in subclasses of their own)."""
    return next(c for c in type(model).__mro__ if c.__module__.startswith("transformers.")).__name__


def _transforms(class_name: str, model_type: str | None) -> list:
    """The class's conversion mapping as transformers looks it up for a root model: by class name, else by
    `model_type`; empty without transformers 5."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return []
    transforms = get_checkpoint_conversion_mapping(class_name)
    if transforms is None and model_type:
        transforms = get_checkpoint_conversion_mapping(model_type)
    return list(transforms or [])


def _renamings(class_name: str, model_type: str | None, saving: bool) -> list:
    """The class's renames: loading also accepts the legacy names (`LayerNorm.gamma`, ...); saving applies the
    reverse renames, in reverse order, without the legacy ones (`transformers.core_model_loading
    .revert_weight_conversion`)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightRenaming
    except ImportError:
        return []
    transforms = _transforms(class_name, model_type)
    if saving:
        transforms = [t.reverse_transform() for t in transforms[::-1] if not isinstance(t, PrefixChange)]
    else:
        transforms += get_checkpoint_conversion_mapping("legacy") or []
    return [t for t in transforms if isinstance(t, WeightRenaming)]


def _apply(names: Iterable[str], renamings: list) -> dict[str, str]:
    renamed = {}
    for name in names:
        new = name
        for renaming in renamings:
            new, _ = renaming.rename_source_key(new)
        renamed[name] = new
    return renamed


def loaded_names(model: nn.Module, checkpoint_names: Iterable[str]) -> dict[str, str]:
    """`{checkpoint name: the name from_pretrained gives it}` for the transformers model `model`."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    return _apply(checkpoint_names, _renamings(library_class_name(model), model_type, saving=False))


def saved_names(class_name: str, model_type: str | None, model_names: Iterable[str]) -> dict[str, str]:
    """`{parameter name: the name save_pretrained stores it under}` for the transformers class `class_name`."""
    return _apply(model_names, _renamings(class_name, model_type, saving=True))


def expert_merges(class_name: str, model_type: str | None) -> list[ExpertMerge]:
    """The class's per-expert -> fused rules (`lightning_dpar.experts.keys`): its `WeightConverter`s that stack
    per-expert tensors on dim 0 (`MergeModulelist(dim=0)`) and, for several parts, concatenate them on dim 1
    (`Concatenate(dim=1)`: gate then up), into one target. The names are the renamed ones (Mixtral's
    `block_sparse_moe.` is `mlp.` by then), as transformers applies its converters after its renames."""
    try:
        from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter
    except ImportError:
        return []
    merges = []
    for transform in _transforms(class_name, model_type):
        if not isinstance(transform, WeightConverter) or len(transform.target_patterns) != 1:
            continue
        sources, ops = tuple(transform.source_patterns), transform.operations
        stacked = len(ops) >= 1 and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
        joined = len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim == 1
        single = len(ops) == 1 and len(sources) == 1
        if stacked and (single or joined) and all(s.count("*") == 1 for s in sources):
            merges.append(ExpertMerge(sources, transform.target_patterns[0]))
    return merges


def model_expert_merges(model: nn.Module) -> list[ExpertMerge]:
    """`expert_merges` of the transformers model `model`."""
    return expert_merges(library_class_name(model), getattr(getattr(model, "config", None), "model_type", None))


def name_in_files(model: nn.Module | None, stored_as: Mapping[str, str]) -> Callable[[str], str]:
    """Names as a checkpoint's files have them, for error messages: `stored_as` (`{loaded name: stored name}`) for
    the names the files hold, and a name they lack as `save_pretrained` of the transformers model `model` would
    store it (Mixtral's `mlp.` is `block_sparse_moe.` there)."""

    def named(name: str) -> str:
        if name in stored_as or model is None:
            return stored_as.get(name, name)
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        return saved_names(library_class_name(model), model_type, [name])[name]

    return named
