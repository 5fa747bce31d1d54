"""float8 training's option (`float8=`, `float8_skip=`), resolved once at the strategy's construction: a recipe name
or a torchao `Float8LinearConfig`, torchao imported (the `float8` extra), every value checked; and the checks that
need the device (`check_float8_device`, before any collective) or the data-parallel wrapper
(`fitted_to_device`: FSDP's float8 all-gather needs NCCL).

Pure but for importing torchao: each refusal names the value, what is valid and the fix, and is raised alike on
every rank."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Union

import torch
from lightning.pytorch.utilities import rank_zero_warn

__all__ = [
    "FLOAT8_DEVICE_CAPABILITY",
    "RECIPES",
    "Float8Options",
    "Float8Setting",
    "check_float8_device",
    "fitted_to_device",
    "recipe_of",
    "resolve_float8",
    "torchao_float8",
]

#: torchao's recipe names (`Float8LinearConfig.from_recipe_name`), which `float8=` takes.
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: The strategies' `float8` argument: a recipe name of `RECIPES`, or a torchao `Float8LinearConfig`.
Float8Setting = Union[str, Any]
#: The first CUDA compute capability with float8 matmuls (`torch._scaled_mm`): Ada (8.9), Hopper (9.0), Blackwell.
FLOAT8_DEVICE_CAPABILITY = (8, 9)

_EXTRA = 'pip install "lightning_dpar[float8]"'


@dataclass(frozen=True)
class Float8Options:
    """A run's float8 setting, resolved: torchao's `Float8LinearConfig` (`config`), the recipe it is (`recipe`: a
    name of `RECIPES`, or `"custom"` for a config no recipe gives), how the strategy's argument read (`setting`,
    for messages), and the module-name patterns kept in high precision (`skip`; `None`: the default, the output
    layer)."""

    config: Any
    recipe: str
    setting: str
    skip: tuple[str, ...] | None = None


def torchao_float8(call: str) -> ModuleType:
    """`torchao.float8`, or an `ImportError` naming the call that needs it and the extra that installs it."""
    try:
        import torchao.float8 as float8
    except ImportError as error:
        raise ImportError(
            f"{call} trains with torchao's float8 Linear layers, and torchao is not installed ({error}). Install the"
            f" extra: `{_EXTRA}` (torchao), or drop `float8=`."
        ) from error
    return float8


def recipe_of(config: Any) -> str:
    """The name of the torchao recipe `config` is (`RECIPES`), ignoring the settings that do not change its numbers
    (`emulate`, `enable_fsdp_float8_all_gather`, `pad_inner_dim`); `"custom"` for any other config."""
    from torchao.float8 import Float8LinearConfig

    neutral = {"emulate": False, "enable_fsdp_float8_all_gather": False, "pad_inner_dim": False}
    plain = dataclasses.replace(config, **neutral)
    for name in RECIPES:
        if dataclasses.replace(Float8LinearConfig.from_recipe_name(name), **neutral) == plain:
            return name
    return "custom"


def resolve_float8(setting: Float8Setting | None, skip: Sequence[str] | None, strategy: str) -> Float8Options | None:
    """The strategy's `float8=` and `float8_skip=` arguments resolved (`None`: no float8): a recipe name becomes
    torchao's config for it, a config is taken as it is. Refused here, at construction (before any process group):
    torchao missing, a name that is no recipe, a value that is neither, and skip patterns that are not strings."""
    if setting is None:
        if skip is not None:
            raise ValueError(
                f"`{strategy}(float8_skip={list(skip)!r})` without `float8=`: the patterns name modules kept in high"
                " precision under float8 training. Give `float8='rowwise'` (or another recipe), or drop `float8_skip`."
            )
        return None
    call = f"`{strategy}(float8={setting!r})`"
    if isinstance(setting, str) and setting not in RECIPES:
        raise ValueError(
            f"{call}: {setting!r} is not a float8 recipe. Give one of {list(RECIPES)} (torchao's recipe names), a"
            " `torchao.float8.Float8LinearConfig`, or drop `float8=`."
        )
    float8 = torchao_float8(call)
    if isinstance(setting, str):
        config = float8.Float8LinearConfig.from_recipe_name(setting)
    elif isinstance(setting, float8.Float8LinearConfig):
        config = setting
    else:
        raise TypeError(
            f"`{strategy}(float8=...)` got a {type(setting).__name__}: give a recipe name ({list(RECIPES)}) or a"
            " `torchao.float8.Float8LinearConfig` (e.g. `dataclasses.replace(Float8LinearConfig.from_recipe_name("
            "'rowwise'), emulate=True)` to emulate float8 on a CPU)."
        )
    if skip is not None:
        if isinstance(skip, str) or not all(isinstance(pattern, str) for pattern in skip):
            raise TypeError(
                f"`{strategy}(float8_skip={skip!r})` must be a list of module-name patterns (fnmatch, e.g."
                " ['model.head', '*.router'])."
            )
        skip = tuple(skip)
    recipe = recipe_of(config)
    if isinstance(setting, str):
        shown = repr(setting)
    else:  # the recipe it is, and whether it emulates: what a refusal's reader needs to recognise it
        named = f"{recipe} recipe" if recipe != "custom" else recipe
        shown = f"Float8LinearConfig(<{named}>{', emulate=True' * config.emulate})"
    return Float8Options(config, recipe, shown, skip)


def check_float8_device(options: Float8Options | None, device: torch.device, strategy: str) -> None:
    """Refuse float8 matmuls on a device without them (a CPU, a GPU older than compute capability 8.9), unless the
    config emulates them (`emulate=True`: the same float8 numbers computed in high precision, for tests). Called
    before any collective."""
    if options is None or options.config.emulate:
        return
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability >= FLOAT8_DEVICE_CAPABILITY:
            return
        has = f"a GPU of compute capability {capability[0]}.{capability[1]}"
    else:
        has = f"the {device.type} device"
    recipe = options.recipe if options.recipe != "custom" else "rowwise"
    raise RuntimeError(
        f"`{strategy}(float8={options.setting})` needs float8 matmuls (`torch._scaled_mm`), which {has} does not"
        f" have: they need a CUDA GPU of compute capability {FLOAT8_DEVICE_CAPABILITY[0]}.{FLOAT8_DEVICE_CAPABILITY[1]}"
        " or newer (Ada, Hopper, Blackwell). To run the same float8 numbers emulated in high precision (slow; for"
        " tests), pass `float8=dataclasses.replace(Float8LinearConfig.from_recipe_name("
        f"{recipe!r}), emulate=True)`; or drop `float8=`."
    )


def fitted_to_device(config: Any, device: torch.device) -> Any:
    """`config` for the run's device: FSDP's float8 all-gather (`enable_fsdp_float8_all_gather`, tensorwise only)
    all-gathers float8 bytes, which needs NCCL; off CUDA (gloo) the parameters are all-gathered in high precision
    instead (the same numbers: each Float8Linear casts the gathered weight with a scale of the whole weight), with
    a warning saying so."""
    if not config.enable_fsdp_float8_all_gather or device.type == "cuda":
        return config
    rank_zero_warn(
        f"float8: `enable_fsdp_float8_all_gather=True` needs NCCL (CUDA); on {device.type} (gloo) FSDP all-gathers"
        " the parameters in high precision instead. The float8 numbers are the same; only the all-gather's bytes"
        " differ."
    )
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=False)
