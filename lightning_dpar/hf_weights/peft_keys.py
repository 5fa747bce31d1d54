"""Names of a `peft`-wrapped model against its base model's: what `get_peft_model` renames, and which parameters it
adds.

`get_peft_model` swaps each targeted layer (`q_proj`) for a tuner layer that keeps the original as `base_layer` and
adds the adapters beside it: the base weight `...q_proj.weight` becomes `...q_proj.base_layer.weight`, and
`...q_proj.lora_A.default.weight` / `...q_proj.lora_B.default.weight` are new. A pretrained base checkpoint names
the weight as the base model does, and has no adapters.

Never imports `peft` itself: a model holding its layers means it is imported (as `checkpoint.hf_export` does for
`transformers`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from torch import nn

__all__ = ["adapter_keys", "is_tuner_layer", "peft_models", "with_base_layers"]


def is_tuner_layer(module: nn.Module) -> bool:
    """Whether `module` is a peft tuner layer wrapping a base layer (LoRA's `Linear`, `Embedding`, ...)."""
    peft = sys.modules.get("peft")
    if peft is None:
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(module, BaseTunerLayer) and isinstance(getattr(module, "base_layer", None), nn.Module)


def peft_models(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost `peft.PeftModel`s inside `root` (or `root` itself), with their module names."""
    peft = sys.modules.get("peft")
    if peft is None:
        return []
    found: list[tuple[str, nn.Module]] = []
    for name, module in root.named_modules():
        if isinstance(module, peft.PeftModel) and not any(name.startswith(f"{o}.") or not o for o, _ in found):
            found.append((name, module))
    return found


def adapter_keys(root: nn.Module) -> set[str]:
    """State-dict keys of the parameters peft added: those of a tuner layer outside its `base_layer`."""
    keys: set[str] = set()
    for name, module in root.named_modules():
        if is_tuner_layer(module):
            prefix = f"{name}." if name else ""
            keys.update(
                prefix + key
                for key, _ in module.named_parameters(remove_duplicate=False)
                if not key.startswith("base_layer.")
            )
    return keys


def with_base_layers(root: nn.Module, names: Mapping[str, str]) -> dict[str, str]:
    """`names` (`{name: anything}`, names as the unwrapped base model has them, relative to it, wherever `root` holds
    it) with each weight of a layer peft wrapped moved under its `base_layer` (`a.q_proj.weight` ->
    `a.q_proj.base_layer.weight`); others unchanged. A layer is found by its name's whole trailing segments among
    `root`'s tuner layers (`layers.0.q_proj` is `model.base_model.model.layers.0.q_proj`), so it works whatever
    the prefix in front of the base model."""
    wrapped: set[str] = set()
    for name, module in root.named_modules():
        if is_tuner_layer(module):
            parts = name.split(".")
            wrapped.update(".".join(parts[i:]) for i in range(len(parts)))
    if not wrapped:
        return dict(names)
    renamed = {}
    for name, value in names.items():
        owner, _, leaf = name.rpartition(".")
        renamed[f"{owner}.base_layer.{leaf}" if owner in wrapped else name] = value
    return renamed
