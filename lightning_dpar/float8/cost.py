"""float8 training as the layout search prices it (`lightning_dpar.layout_search`): the recipes and devices it can
price, the layouts it leaves out, and the compute time of a step whose converted matmuls run at the device's float8
rate.

A model of the matmuls alone: the FLOPs of the `nn.Linear` layers float8 converts (6 per weight and token, each of
their forward and backward matmuls converted, recomputed alike under activation checkpointing) run at the device's
`float8_matmul_flops`, the rest (attention, the output layer, unconverted layers) at its `matmul_flops`. It leaves
out the casts and scales float8 adds (torchao measures +25% tensorwise, +10% rowwise end-to-end on H100, against the
up to 2x the matmul rates give here). Pure functions of numbers; a device (a hardware profile) is read through
`Float8Device`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from lightning_dpar.float8.config import RECIPES
from lightning_dpar.float8.step import layout_refusal
from lightning_dpar.parallel_dims import ParallelDims

__all__ = ["Float8Device", "check_recipe", "compute_seconds", "converted_flops_per_token", "layout_reason"]


class Float8Device(Protocol):
    """What the pricing reads of a hardware profile (`lightning_dpar.layout_search.profiles.HardwareProfile`): its
    name, and its sustained matmul rates, FLOP/s (`float8_matmul_flops` `None`: no float8 matmuls)."""

    @property
    def name(self) -> str: ...

    @property
    def matmul_flops(self) -> float: ...

    @property
    def float8_matmul_flops(self) -> float | None: ...


def check_recipe(recipe: str | None, device: Float8Device, presets: Mapping[str, Float8Device]) -> None:
    """Refuse, naming the fix, a `float8=` that is not one of torchao's recipes, or one on a `device` without float8
    matmuls (`float8_matmul_flops` is `None`: an A100, a CPU, a calibrated profile); the message names the
    `presets` that have them."""
    if recipe is None:
        return
    if recipe not in RECIPES:
        raise ValueError(f"`float8={recipe!r}` is not a float8 recipe: give one of {list(RECIPES)}, or None.")
    if device.float8_matmul_flops is None:
        with_float8 = sorted(name for name, preset in presets.items() if preset.float8_matmul_flops)
        raise ValueError(
            f"`float8={recipe!r}` on profile {device.name!r}, whose device has no float8 matmuls"
            f" (`float8_matmul_flops` is unset): float8 training needs an H100 or newer. Drop `float8=`, use a"
            f" profile of such a device ({with_float8}), or, for a calibrated profile of one, add its sustained"
            " `float8_matmul_flops` (FLOP/s) to the JSON file."
        )


def layout_reason(recipe: str | None, dims: ParallelDims) -> str | None:
    """Why the layout search leaves out the layout `dims` under `float8=recipe` (what the float8 step refuses:
    `lightning_dpar.float8.step.layout_refusal`), or None if it can train it (or without float8)."""
    refusal = None if recipe is None else layout_refusal(recipe == "tensorwise", dims)
    return None if refusal is None else f"float8 {refusal}"


def converted_flops_per_token(converted_params: int, recompute_factor: float) -> float:
    """Training FLOPs per token that float8 runs in float8: 6 x the converted weights, times the activation
    checkpointing's `recompute_factor` (the recomputed share taken as spread evenly over the matmuls)."""
    return 6.0 * converted_params * recompute_factor


def compute_seconds(recipe: str | None, flops: float, converted_flops: float, device: Float8Device) -> float:
    """Seconds for `flops` of matmuls on `device`, `converted_flops` of them in float8 under `float8=recipe` (at its
    float8 rate; `check_recipe` first), all at its plain rate without float8."""
    if recipe is None:
        return flops / device.matmul_flops
    assert device.float8_matmul_flops is not None, "check_recipe refuses a device without float8 matmuls"
    return (flops - converted_flops) / device.matmul_flops + converted_flops / device.float8_matmul_flops
