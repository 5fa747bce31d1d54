"""What the Fabric strategies refuse: at construction (`Fabric(strategy=...)`), before any process group or
collective, the strategy arguments whose feature needs the Trainer's loop; in `fabric.setup`, before the model is
parallelised, a model Fabric's setup cannot take as its root. Each is refused by name with why and what to use
instead. Pure: every rank raises the same error from the same arguments and model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from lightning_dpar.helpers import is_transformers_model

__all__ = ["TRAINER_ONLY", "check_fabric_arguments", "check_fabric_model"]

#: Strategy arguments (with the value that switches their feature off) that Fabric cannot drive, and why.
TRAINER_ONLY: dict[str, tuple[Any, str]] = {
    "pipeline_parallel_size": (
        1,
        "a pipeline schedule runs every microbatch's forward, loss and backward itself, across the stages; Fabric's"
        " loop calls the model's forward and `fabric.backward(loss)` on one loss, so the loss cannot sit inside the"
        " schedule",
    ),
    "context_parallel_size": (
        1,
        "context parallelism splits each batch's sequences inside the Trainer's step hooks (and reshapes the loss"
        " there); a Fabric loop's batches and loss are the user's and are not split",
    ),
    "loss_parallel": (
        False,
        "torch's `loss_parallel()` must be entered around the loss's computation and around its backward; a Fabric"
        " loop computes the loss in the user's code, outside the model's forward that the strategy wraps",
    ),
    "fault_tolerance": (
        None,
        "torchft's per-step protocol (quorum, cross-group gradient averaging, commit) runs in the Trainer's step"
        " hooks, around Lightning's optimizer step",
    ),
}


def check_fabric_arguments(strategy: str, arguments: Mapping[str, Any]) -> None:
    """Refuse the arguments of `TRAINER_ONLY` set to anything but their off value, naming the argument, why Fabric
    cannot drive it, and the fix (the same strategy under the Trainer, or the argument dropped)."""
    for name, (off, why) in TRAINER_ONLY.items():
        if name not in arguments or arguments[name] == off:
            continue
        raise ValueError(
            f"`lightning_dpar.fabric.{strategy}({name}={arguments[name]!r})` cannot run under Fabric: {why}. Use"
            f" `lightning_dpar.{strategy}({name}={arguments[name]!r})` with the Trainer (`Trainer(strategy=...)`), or"
            f" leave `{name}` at {off!r} under Fabric."
        )


def check_fabric_model(module: nn.Module, strategy: str) -> None:
    """Refuse a transformers MoE model with `output_router_logits=True` set up as the root module: parallelised as
    the root (it never is under the Trainer, where a LightningModule holds it), its forward returns no router logits
    and transformers fails adding the load-balancing loss (`'int' object has no attribute 'to'`; seen on transformers
    5.24, one rank or more, with or without expert parallelism). Held by a parent module it trains exactly, the router
    loss over the global batch (`tests/launched/test_fabric.py`)."""
    if is_transformers_model(module) and getattr(module.config, "output_router_logits", False) is True:
        raise ValueError(
            f"`fabric.setup` got {type(module).__name__} with `output_router_logits=True` as the model itself:"
            f" parallelised by `{strategy}` as the root module, it returns no router logits and transformers fails"
            " adding its load-balancing loss. Set up a parent module that holds it (e.g. `class Held(nn.Module)` with"
            " `self.net = model` and a `forward` calling it), as a LightningModule holds it under the Trainer, or set"
            " `output_router_logits=False`."
        )
