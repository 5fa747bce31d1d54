"""transformers' checkpoint key renamings: the names a model's weights have in its `save_pretrained` files, which
are not always the names of its parameters.

transformers 5 keeps a conversion mapping per model class: GPT-NeoX's output head is the parameter `lm_head.weight`
but is stored as `embed_out.weight` (every Pythia checkpoint on the Hub, and `save_pretrained` today).
`from_pretrained` renames on load and `save_pretrained` renames back. Loading pretrained weights into shards
(`lightning_dpar.pretrained`) and `consolidate --format hf` (`lightning_dpar.checkpoint.hf_export`) apply the same
renames, so both see the files as transformers does.

Only pure renames (`WeightRenaming`) are applied. A class whose checkpoints need tensors merged or split
(`WeightConverter`: per-expert weights packed into one) keeps its checkpoint names here, and strict loading names
the keys that do not fit. Without transformers, or with one older than 5 (no conversion mapping), nothing is renamed.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = ["library_class_name", "loaded_names", "saved_names"]


def library_class_name(model: nn.Module) -> str:
    """The transformers class of `model` (FSDP2 and `replicate` swap in subclasses of their own)."""
    return next(c for c in type(model).__mro__ if c.__module__.startswith("transformers.")).__name__


def _renamings(class_name: str, model_type: str | None, saving: bool) -> list:
    """The class's renames as transformers looks them up for a root model: by class name, else by `model_type`;
    loading also accepts the legacy names (`LayerNorm.gamma`, ...); saving applies the reverse renames, in reverse
    order, without the legacy ones (`transformers.core_model_loading.revert_weight_conversion`)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightRenaming
    except ImportError:
        return []
    transforms = get_checkpoint_conversion_mapping(class_name)
    if transforms is None and model_type:
        transforms = get_checkpoint_conversion_mapping(model_type)
    transforms = list(transforms or [])
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
