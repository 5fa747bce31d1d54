"""Small helpers shared across the package, each defined once: module-name matching and grouping, divisors, sizes in
bytes (a tensor's local elements, a byte count for people), showing a few names in an error message, naming a class,
the Trainer a LightningModule is attached to, and facts about a module (does it hold parameters, is it a
transformers model), and a transformers model's training forward without a key/value cache.

A leaf: this module imports nothing from `lightning_dpar`, so any module may import it without an import cycle.
"""

from __future__ import annotations

import re
from collections.abc import Generator, Iterable, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "attached_trainer",
    "class_name",
    "divisors",
    "format_bytes",
    "group_modules",
    "has_parameters",
    "is_transformers_model",
    "is_under",
    "key_value_cache_configs",
    "local_numel",
    "process_memory",
    "show_names",
    "text_table",
    "transformers_models",
    "wildcard_indices",
    "without_key_value_cache",
]

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


def is_under(fqn: str, units: Sequence[str]) -> bool:
    """Whether `fqn` names one of `units` or something inside one (a parameter, a submodule)."""
    return any(fqn == unit or fqn.startswith(f"{unit}.") for unit in units)


def wildcard_indices(fqn: str) -> str:
    """`blocks.3.attn` -> `blocks.*.attn`: the name with each index of a repeated module replaced by `*` (a digit
    inside a name, `layer2`, is not an index)."""
    return _INDEX.sub("*", fqn)


def group_modules(modules: dict[str, list[str]]) -> list[tuple[str, list[str], int]]:
    """Collapse `blocks.0.x`, `blocks.1.x`, ... that get the same treatment into `blocks.*.x  xN`."""
    groups: dict[tuple[str, tuple[str, ...]], int] = {}
    for fqn, what in modules.items():
        key = (wildcard_indices(fqn), tuple(what))
        groups[key] = groups.get(key, 0) + 1
    return [(name, list(what), n) for (name, what), n in groups.items()]


def local_numel(param: torch.Tensor) -> int:
    """Elements this rank stores: its shard for a DTensor, everything for a plain tensor."""
    return param.to_local().numel() if isinstance(param, DTensor) else param.numel()


def format_bytes(n: float) -> str:
    """`1536` -> `"1.50 KiB"`."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    index = 0
    while abs(n) >= 1024 and index < len(units) - 1:
        n /= 1024
        index += 1
    return f"{n:.0f} B" if index == 0 else f"{n:.2f} {units[index]}"


def divisors(n: int) -> list[int]:
    """The positive divisors of `n`, ascending: the sizes that split `n` evenly (valid sizes in error messages)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def show_names(names: Iterable[str], limit: int = 6, *, bracketed: bool = True, count_rest: bool = False) -> str:
    """The first `limit` names, quoted, for an error message: `['a', 'b', ...]`; unbracketed `'a', 'b'`; with
    `count_rest`, `'a', 'b' and 3 more`."""
    names = list(names)
    shown = ", ".join(repr(name) for name in names[:limit])
    if len(names) > limit:
        if count_rest:
            shown += f" and {len(names) - limit} more"
        elif bracketed:
            shown += ", ..."
    return f"[{shown}]" if bracketed else shown


def text_table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> list[str]:
    """`rows` under `header` as lines of left-aligned columns, indented two spaces; no lines without rows."""
    if not rows:
        return []
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return ["  " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]


def attached_trainer(module: pl.LightningModule | None) -> pl.Trainer | None:
    """The Trainer `module` is attached to, or None (`LightningModule.trainer` raises when there is none)."""
    try:
        return module.trainer if module is not None else None
    except RuntimeError:
        return None


def has_parameters(module: nn.Module) -> bool:
    """Whether `module` or any submodule holds a parameter (without materialising the list)."""
    return any(True for _ in module.parameters())


def is_transformers_model(module: nn.Module) -> bool:
    """Whether `module` is a `transformers.PreTrainedModel` (checked by name: transformers is optional)."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.") for cls in type(module).__mro__
    )


def transformers_models(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost transformers models inside `root` (or `root` itself), with their module names."""
    found: list[tuple[str, nn.Module]] = []
    for fqn, module in root.named_modules():
        if is_transformers_model(module) and not any(fqn.startswith(f"{outer}.") or not outer for outer, _ in found):
            found.append((fqn, module))
    return found


def class_name(obj: object) -> str:
    """The qualified name of `obj`'s class (of `obj` itself if it is a class): `module.QualName`; builtins bare.

    How error messages name a class: a bare name can contradict the message it stands in (peft's LoRA wrapper of a
    `torch.nn.Linear` is also called `Linear`, so "cannot shard 'q_proj' (Linear): it supports Linear only" said
    nothing).
    """
    cls = obj if isinstance(obj, type) else type(obj)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def process_memory(field: str) -> int:
    """A memory figure of this process from `/proc/self/status`, in bytes (`"VmRSS"`: resident now, `"VmHWM"`: the
    resident peak); 0 where the field or the file is missing (not Linux)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def key_value_cache_configs(module: nn.Module) -> tuple[Any, ...]:
    """The configs of the transformers models in `module` that build a key/value cache in each forward
    (`config.use_cache`, true by default), each once (a causal-LM head and its base model share theirs)."""
    configs: dict[int, Any] = {}
    for submodule in module.modules():
        config = getattr(submodule, "config", None)
        if is_transformers_model(submodule) and getattr(config, "use_cache", False) is True:
            configs[id(config)] = config
    return tuple(configs.values())


@contextmanager
def without_key_value_cache(configs: Sequence[Any]) -> Generator[None, None, None]:
    """`use_cache=False` on these configs during a training forward, as transformers itself does under gradient
    checkpointing and as hand-written training loops pass it.

    The cache changes no output of a training forward; a step never reads it back. But a transformers decoder makes
    a `DynamicCache` when `use_cache` is true and no cache is given, and each compiled decoder layer then guards on
    the cache's per-layer state: every layer recompiled until dynamo's recompile limit (8), and the rest ran
    eagerly (issue 31). Evaluation and generation keep the model's own setting."""
    for config in configs:
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs:
            config.use_cache = True
