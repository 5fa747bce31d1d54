"""float8 training (`float8=`, torchao's `Float8Linear`; the `float8` extra): see docs/efficiency.md.

- `config`: the option resolved (`resolve_float8`: a recipe name or a torchao `Float8LinearConfig`, torchao
  imported), the device check (`check_float8_device`: float8 matmuls, or `emulate=True`) and FSDP's float8
  all-gather fitted to the device (`fitted_to_device`);
- `step`: the step of the parallelisation: its slice of the plan (`plan_float8`, the converted modules, with every
  refusal) and how it is applied (`apply_float8`).

`cost`: the recipe check, the layouts it leaves out and its matmul time in the layout search.
"""

from lightning_dpar.float8.config import (
    RECIPES,
    Float8Options,
    Float8Setting,
    check_float8_device,
    fitted_to_device,
    resolve_float8,
)
from lightning_dpar.float8.step import Float8Plan, apply_float8, converted_modules, plan_float8

__all__ = [
    "RECIPES",
    "Float8Options",
    "Float8Plan",
    "Float8Setting",
    "apply_float8",
    "check_float8_device",
    "converted_modules",
    "fitted_to_device",
    "plan_float8",
    "resolve_float8",
]
