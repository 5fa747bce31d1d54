"""A guard against silently unsynchronised gradients under DDP (`replicate`).

DDP all-reduces a wrapped unit's gradients only when the unit's own `forward` ran (its forward hooks prepare the
reducer). A model that calls a unit's submodules directly (`self.model.layers[0](x)` where `self.model` is the
unit), or a unit that is a container whose `forward` nobody calls, trains each rank on its own gradients and
diverges without an error. `UnitCallGuard` turns that into an error naming the unit, at the first backward.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from torch import Tensor, nn

__all__ = [
    "UnitCallGuard",
]


class UnitCallGuard:
    """Raises when a parameter of a wrapped unit gets a gradient although the unit's `forward` did not run since the
    last `reset()` (call it after each backward)."""

    def __init__(self, units: Mapping[str, nn.Module]) -> None:
        self._called: set[str] = set()
        for name, unit in units.items():
            unit.register_forward_pre_hook(partial(self._mark_called, name))
            for parameter in unit.parameters():
                if parameter.requires_grad:
                    parameter.register_post_accumulate_grad_hook(partial(self._check_called, name))

    def _mark_called(self, name: str, module: nn.Module, args: Any) -> None:
        self._called.add(name)

    def _check_called(self, name: str, parameter: Tensor) -> None:
        if name not in self._called:
            raise RuntimeError(
                f"A parameter of {name!r} received a gradient, but the `forward` of {name!r} was not called in this"
                " step: its submodules were called directly. DDP synchronises a unit's gradients only when its"
                " `forward` runs, so the ranks would silently diverge. Call the module itself (e.g. `self.model(x)`),"
                " or call its parts from its own `forward`."
            )

    def reset(self) -> None:
        self._called.clear()
