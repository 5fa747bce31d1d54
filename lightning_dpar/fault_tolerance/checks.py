"""What fault tolerance refuses, before any collective and alike on every rank: torchft missing, a config that does
not resolve, a lighthouse nobody answers at, a layout it does not support, Trainer settings whose steps it cannot
make safe."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightning_dpar.fault_tolerance.config import LIGHTHOUSE_PROBE_TIMEOUT, FaultTolerance, check_lighthouse_reachable

if TYPE_CHECKING:
    from lightning_dpar.parallel_dims import ParallelDims

__all__ = ["check_fault_tolerance", "check_trainer", "require_torchft"]


def require_torchft() -> None:
    """Raise `ModuleNotFoundError` with the install command when torchft is not installed."""
    if importlib.util.find_spec("torchft") is None:
        raise ModuleNotFoundError(
            "Fault tolerance needs torchft, which is not installed: `pip install 'lightning_dpar[ft]'` (or"
            " `pip install torchft==0.2.0`)."
        )


def check_fault_tolerance(config: FaultTolerance, dims: ParallelDims, reach_lighthouse: bool = True) -> FaultTolerance:
    """The config resolved against the environment and checked against this launch's layout `dims`; raises before
    any process group exists."""
    require_torchft()
    resolved = config.resolved()
    if dims.pipeline > 1:
        raise ValueError(
            f"Fault tolerance with pipeline parallelism (`pipeline_parallel_size={dims.pipeline}`) is not supported:"
            " a replica group that loses one stage loses the whole group, and torchft's quorum heals whole groups"
            " from a peer holding the same stage, which this package does not arrange. Use"
            " `pipeline_parallel_size=1`, or train with pipelines without `fault_tolerance`."
        )
    if resolved.group_size is not None and resolved.group_size != dims.world_size:
        raise ValueError(
            f"`FaultTolerance(group_size={resolved.group_size})` but this launch has {dims.world_size} ranks: each"
            " launch (one torchrun, or one Ray replica group) is exactly one replica group. Launch"
            f" {resolved.group_size} ranks per group, or set `group_size={dims.world_size}`."
        )
    if reach_lighthouse:
        assert resolved.lighthouse is not None
        check_lighthouse_reachable(resolved.lighthouse, min(LIGHTHOUSE_PROBE_TIMEOUT, resolved.quorum_timeout))
    return resolved


def check_trainer(trainer: Any | None, optimizers: Sequence[Any] | None = None) -> None:
    """Trainer settings and optimizers the per-step protocol cannot run: gradient accumulation (a heal would land
    between micro-batches), manual optimisation (the strategy does not see its steps), several optimizers (one
    commit decides one step)."""
    if trainer is None:
        return
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"Fault tolerance with `Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})` is not"
            " supported: a group healed between micro-batches would mix gradients of two sets of weights. Use"
            " `accumulate_grad_batches=1` with a larger batch, or more ranks per group."
        )
    module = trainer.lightning_module
    if module is not None and not module.automatic_optimization:
        raise ValueError(
            "Fault tolerance needs automatic optimisation: under manual optimisation the strategy cannot hold each"
            " optimizer step until torchft commits it. Set `self.automatic_optimization = True`."
        )
    if optimizers is not None and len(optimizers) != 1:
        raise ValueError(
            f"Fault tolerance supports exactly one optimizer; `configure_optimizers` returned {len(optimizers)}. Use"
            " one optimizer with several parameter groups."
        )
