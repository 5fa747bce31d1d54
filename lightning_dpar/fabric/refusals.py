"""What the Fabric strategies refuse, at construction (`Fabric(strategy=...)`), before any process group or
collective: the strategy arguments whose feature needs the Trainer's loop, each refused by name with why and what to
use instead. Pure: every rank raises the same error from the same arguments."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["TRAINER_ONLY", "check_fabric_arguments"]

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
    "fault_tolerance": (
        None,
        "torchft's per-step protocol (quorum, cross-group gradient averaging, commit) runs in the Trainer's step"
        " hooks, around Lightning's optimizer step",
    ),
    "expert_parallel_size": (
        1,
        "the global router loss and the per-expert checkpoint keys are tested through the Trainer's steps only",
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
