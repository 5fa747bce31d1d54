"""Matching checkpoint keys to a model's keys: which checkpoint tensor fills which parameter, counting tied names as
one, and what does not fit. Pure (keys and shapes only), shared by loading pretrained weights
(`lightning_dpar.hf_weights.pretrained`) and `consolidate --format hf` (`lightning_dpar.checkpoint.hf_export`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torch import nn

from lightning_dpar.helpers import show_names
from lightning_dpar.plan.ties import tied_parameters

__all__ = ["KeyMapping", "describe", "map_keys", "tied_groups"]


def tied_groups(module: nn.Module) -> list[list[str]]:
    """Names that share one parameter (e.g. `lm_head.weight` and `embed_tokens.weight` under
    `tie_word_embeddings`); any one of them in the checkpoint sets them all."""
    return [list(group) for group in tied_parameters(module)]


@dataclass
class KeyMapping:
    """Which checkpoint key fills which model key, and what does not fit."""

    to_model: dict[str, str] = field(default_factory=dict)  # checkpoint key -> model key
    missing: list[str] = field(default_factory=list)  # model keys the checkpoint has no value for
    unexpected: list[str] = field(default_factory=list)  # checkpoint keys the model lacks
    mismatched: list[str] = field(default_factory=list)  # "key: checkpoint (..), model (..)"
    # Checkpoint tensors that do not make the model's parameter they are parts of (per-expert tensors of a fused
    # expert parameter: one missing or mis-shaped, or both layouts at once), each a sentence naming them; refused
    # strict or not, since no part of such a parameter can be loaded on its own.
    incomplete: list[str] = field(default_factory=list)

    def problems(self, strict: bool) -> list[str]:
        found = [f"shapes differ: {', '.join(self.mismatched)}"] if self.mismatched else []
        if strict and self.missing:
            missing = show_names(self.missing, 20, bracketed=False, count_rest=True)
            found.append(f"keys of the model not in the checkpoint: {missing}")
        if strict and self.unexpected:
            unexpected = show_names(self.unexpected, 20, bracketed=False, count_rest=True)
            found.append(f"keys of the checkpoint not in the model: {unexpected}")
        return found + self.incomplete


def map_keys(
    model_shapes: Mapping[str, tuple[int, ...]],
    checkpoint: Mapping[str, tuple[int, ...]],
    prefix: str,
    tied: Sequence[Sequence[str]] = (),
) -> KeyMapping:
    """Match checkpoint keys to model keys (`prefix + key`), counting a tied name as present when another name of
    its group is. Pure: the model and checkpoint are described by their keys and (global) shapes."""
    mapping = KeyMapping()
    for key, shape in checkpoint.items():
        model_key = prefix + key
        if model_key not in model_shapes:
            mapping.unexpected.append(key)
        elif tuple(model_shapes[model_key]) != tuple(shape):
            mapping.mismatched.append(f"{key}: checkpoint {tuple(shape)}, model {tuple(model_shapes[model_key])}")
        else:
            mapping.to_model[key] = model_key
    loaded = set(mapping.to_model.values())
    tie_of = {name: group for group in tied for name in group}
    for model_key in model_shapes:
        if model_key not in loaded and not any(name in loaded for name in tie_of.get(model_key, ())):
            mapping.missing.append(model_key)
    # One read per shared parameter: a second name of the same group would write the same storage again.
    seen_groups: set[int] = set()
    for key, model_key in list(mapping.to_model.items()):
        group = tie_of.get(model_key)
        if group is not None:
            if id(group) in seen_groups:
                del mapping.to_model[key]
            seen_groups.add(id(group))
    return mapping


def describe(mapping: KeyMapping) -> str:
    """One line for the log about a non-strict load's gaps."""
    parts: list[str] = []
    if mapping.missing:
        missing = show_names(mapping.missing, 20, bracketed=False, count_rest=True)
        parts.append(f"kept their own initialisation (not in the checkpoint): {missing}")
    if mapping.unexpected:
        unexpected = show_names(mapping.unexpected, 20, bracketed=False, count_rest=True)
        parts.append(f"ignored (not in the model): {unexpected}")
    return "; ".join(parts)
