"""Activation checkpointing as the layout search prices it (`lightning_dpar.layout_search`): the compute it adds by
recomputing the forward, and the collectives the recomputed forward runs again (the activation figure a setting
takes is `estimate.figure_of`, shared with the dry run). Pure functions of numbers and of the setting
(`Checkpointing`: `False`, `True` for full, `"selective"`).

Full checkpointing recomputes each block's forward once more in backward: 8 FLOPs per parameter and token instead
of 6. Selective checkpointing recomputes only what its op-level policy does not keep: the share of full's
recomputation the dry run's trace measured (`selective_share`, from the traced step's FLOPs).
"""

from __future__ import annotations

from lightning_dpar.activation_checkpointing.estimate import StepFlops, figure_of
from lightning_dpar.activation_checkpointing.step import Checkpointing

__all__ = ["collective_passes", "recompute_factor", "selective_share"]


def recompute_factor(checkpointing: Checkpointing, selective_share: float | None = None) -> float:
    """Training FLOPs with `checkpointing` over those without: 8 / 6 full, `1 + 2 / 6 x selective_share` selective
    (`None`: not traced, priced as full, an upper bound), 1 without."""
    share = 1.0 if selective_share is None else selective_share
    return figure_of(checkpointing, 1.0, 8.0 / 6.0, 1.0 + (2.0 / 6.0) * share)


def collective_passes(checkpointing: Checkpointing) -> int:
    """How many times a block's forward-and-backward collectives (tensor parallelism's all-reduces, expert
    parallelism's all-to-alls) run per microbatch: 2 forward and 2 backward, and 6 with checkpointing, full or
    selective (the recomputed forward runs its 2 again: the selective policy keeps reduce-scatters' outputs, not
    all-reduces')."""
    return 6 if checkpointing else 4


def selective_share(flops: StepFlops | None) -> float | None:
    """The share of full checkpointing's recomputed FLOPs that selective checkpointing recomputes, on a traced
    step's `flops`; `None` without a trace or when full checkpointing recomputes nothing."""
    if flops is None or flops.recomputed(True) <= 0:
        return None
    return flops.recomputed("selective") / flops.recomputed(True)
