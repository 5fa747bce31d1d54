"""What activation checkpointing does to a step's memory and FLOPs, for `lightning_dpar.estimates` (the `plan` dry
run's traced figures, and the activation formula a layout search falls back on): which traced figure a setting
stands for, what a checkpointed layer keeps and what its recomputation adds, the FLOPs each setting recomputes
(`StepFlops`), and how the report names each setting.

Pure: the estimates pass their figures and numbers in, so this module needs nothing above its folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from lightning_dpar.activation_checkpointing.step import Checkpointing

__all__ = ["CHECKPOINTING_NAMES", "StepFlops", "checkpointed_layers", "figure_of"]

#: How the `plan` report names each activation checkpointing setting.
CHECKPOINTING_NAMES: dict[Checkpointing, str] = {
    False: "without activation checkpointing",
    "selective": "selective activation checkpointing",
    True: "full activation checkpointing",
}

Figure = TypeVar("Figure")


def figure_of(checkpointing: Checkpointing, without: Figure, full: Figure, selective: Figure | None) -> Figure:
    """The figure traced under `checkpointing`: `without` checkpointing, with `full` checkpointing, or with
    `selective` checkpointing (`None`: not traced, then the full figure stands in, an upper bound)."""
    if checkpointing == "selective" and selective is not None:
        return selective
    return full if checkpointing else without


def checkpointed_layers(checkpointing: bool, layers: int, layer_input: int, whole_layer: float) -> tuple[float, float]:
    """What `layers` transformer layers keep of one microbatch for its backward (`whole_layer` bytes each, of which
    `layer_input` is the layer's input), and what recomputation adds on top during the backward: with (full)
    checkpointing each layer keeps only its input and one layer at a time is recomputed whole; without, each keeps
    everything and nothing is recomputed."""
    if checkpointing:
        return layers * layer_input, whole_layer
    return layers * whole_layer, 0


@dataclass(frozen=True)
class StepFlops:
    """The FLOPs of one microbatch's forward and backward on one simulated rank (the whole model, unsplit by tensor
    parallelism), without activation checkpointing and with each kind: the matmul and attention FLOPs the traces
    ran. The difference is what checkpointing recomputes."""

    plain: int
    full: int
    selective: int

    def recomputed(self, checkpointing: Checkpointing) -> int:
        """FLOPs recomputed in backward under `checkpointing`."""
        if checkpointing is False:
            return 0
        return (self.selective if checkpointing == "selective" else self.full) - self.plain

    def recomputed_fraction(self, checkpointing: Checkpointing) -> float:
        """Recomputed FLOPs over the step's FLOPs without checkpointing (full checkpointing of every block: about
        a third, the forward again)."""
        return self.recomputed(checkpointing) / self.plain if self.plain else 0.0
