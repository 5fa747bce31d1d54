"""Lightning's private names the package relies on: its strategy registry type, launchers, process-group and
optimizer helpers, the Trainer state it reads before `setup`, and the private hooks a strategy subclass must
override. Each has no public equivalent in lightning 2.6 (checked on 2.6.6); each says why it is needed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn

# Fabric's launchers (the ones its own `ModelParallelStrategy` and `DDPStrategy` configure in `_configure_launcher`):
# `lightning_dpar.fabric` starts its ranks as the Trainer side does, through Lightning's own launchers.
from lightning.fabric.strategies.launchers.multiprocessing import (
    _MultiProcessingLauncher as FabricMultiProcessingLauncher,
)
from lightning.fabric.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as FabricSubprocessScriptLauncher,
)

# The type of Lightning's strategy registry, which `Strategy.register_strategies(registry)` receives: the public
# `StrategyRegistry` is an instance of it, and the class itself is only exported privately.
from lightning.fabric.strategies.registry import _StrategyRegistry as StrategyRegistryType

# The interface through which `Fabric.no_backward_sync` asks a strategy to skip gradient sync: Fabric reads
# `strategy._backward_sync_control`, an instance of this private base class, and has no public one.
from lightning.fabric.strategies.strategy import _BackwardSyncControl as BackwardSyncControl

# Lightning's launchers, process-group initialisation and reduction helper: the building blocks every built-in
# Lightning strategy uses; re-implementing them would diverge from Lightning's env handling (SLURM, torchelastic).
from lightning.fabric.utilities.distributed import _init_dist_connection as init_dist_connection
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_ddp_if_available
from lightning.fabric.utilities.imports import _IS_INTERACTIVE as IS_INTERACTIVE

# Moves optimizer state to the device the way Lightning's own strategies do in `setup` (keeping `step` where
# `torch.optim` expects it); Lightning has no public helper for it.
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device

# The base class of Lightning's launchers: the only hook that runs before Lightning resolves `ckpt_path="last"`
# (in `Trainer._fit_impl` and friends), where a crashed save must be looked past (`checkpoint.discovery`).
from lightning.pytorch.strategies.launchers.launcher import _Launcher as Launcher
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _MultiProcessingLauncher as MultiProcessingLauncher,
)
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput as WorkerOutput
from lightning.pytorch.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as SubprocessScriptLauncher,
)
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "IS_INTERACTIVE",
    "LIGHTNING_SUBCLASS_HOOKS",
    "BackwardSyncControl",
    "FabricMultiProcessingLauncher",
    "FabricSubprocessScriptLauncher",
    "Launcher",
    "MultiProcessingLauncher",
    "StrategyRegistryType",
    "SubprocessScriptLauncher",
    "WorkerOutput",
    "attach_device_mesh",
    "averaged_copy",
    "detect_anomaly_requested",
    "init_dist_connection",
    "layer_sync_requested",
    "model_checkpoint_dir",
    "optimizers_to_device",
    "replace_model_checkpoint_link",
    "sync_ddp_if_available",
    "trainer_and_mesh",
    "training_data_source",
    "unfetched_training_iterator",
]


def layer_sync_requested(strategy: Any) -> bool:
    """Whether `Trainer(sync_batchnorm=True)` was given (Lightning's private `_layer_sync`; no public accessor)."""
    return getattr(strategy, "_layer_sync", None) is not None


def detect_anomaly_requested(trainer: Any) -> bool:
    """Whether the Trainer was made with `detect_anomaly=True` (kept only as `_detect_anomaly`; refused in setup)."""
    return bool(getattr(trainer, "_detect_anomaly", False))


def unfetched_training_iterator(trainer: Any) -> Any | None:
    """The iterator Lightning's fit loop draws training batches from, if it has not pre-fetched any yet (no public
    handle): where the batches a non-resumable loader already yielded before a mid-epoch checkpoint are skipped."""
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    if fetcher is None or getattr(fetcher, "batches", None) or getattr(fetcher, "iterator", None) is None:
        return None
    return fetcher.iterator


def training_data_source(trainer: Any) -> Any | None:
    """What `trainer.fit` was given to train on (a `DataLoader`, a `LightningDataModule`, or the LightningModule
    itself), before any loader is built.

    Lightning has no public handle on it before `setup`. `AutoParallelStrategy` reads the per-rank batch size from it
    in `setup_environment`, to choose the layout before the process group exists (microbatches must divide it)."""
    source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)
    return getattr(source, "instance", None)


def attach_device_mesh(module: Any, mesh: DeviceMesh) -> None:
    """Make `mesh` the LightningModule's public `device_mesh` (what `configure_model` parallelises with).

    Lightning's `device_mesh` property is read-only; its own `ModelParallelStrategy` sets the attribute behind it."""
    module._device_mesh = mesh


def model_checkpoint_dir(callback: Any, trainer: Any) -> str | None:
    """The directory a `ModelCheckpoint` saves into: before `fit` sets it up, only its private resolver knows."""
    return str(callback.dirpath or callback._ModelCheckpoint__resolve_ckpt_dir(trainer))


def replace_model_checkpoint_link(callback: Any, link: Callable[[Any, str, str], None]) -> None:
    """Make `callback` (a `ModelCheckpoint`) make its `save_last="link"` link with `link(trainer, filepath, linkpath)`,
    shadowing (for this instance only) the private static `_link_checkpoint` Lightning calls right after the save
    returns: with an async save the checkpoint is still being written then (no public hook)."""
    callback._link_checkpoint = link


#: Lightning private names a strategy or launcher subclass must override or set: Lightning's extension points for
#: them are private, so there is no public way. `tests/unit/test_private_api.py` accepts `self._name` uses of
#: Lightning's private names only if listed here.
LIGHTNING_SUBCLASS_HOOKS = {
    "_configure_launcher": "Strategy subclasses choose their launcher here (Lightning's abstract hook).",
    "_launcher": "the attribute `_configure_launcher` must set; Lightning reads it to launch the processes.",
    "_precision_plugin": "the attribute behind `Strategy.precision_plugin`, which we override to translate plugins.",
    "_precision": "the attribute behind Fabric's `Strategy.precision`, which we override to translate plugins.",
    "_backward_sync_control": "what `Fabric.no_backward_sync` asks to skip gradient sync; Fabric reads only this.",
    "_strategy": "the strategy a `_MultiProcessingLauncher` subclass launches, stored by its base class.",
    "_collect_rank_zero_results": "the launcher's hook for what rank 0 hands back to the interactive process; ours"
    " gathers the sharded weights (Lightning's sends rank 0's shards only).",
}


def averaged_copy(callback: Any) -> nn.Module | None:
    """The module holding a Lightning weight-averaging callback's averaged weights (None before its `setup`), which
    the strategy lays out like the model: `WeightAveraging` keeps an `AveragedModel` in `_average_model` (the copy is
    its `module`), `StochasticWeightAveraging` the copied LightningModule itself; neither exposes it."""
    from torch.optim.swa_utils import AveragedModel

    average = callback._average_model
    return average.module if isinstance(average, AveragedModel) else average


def trainer_and_mesh(module: nn.Module) -> tuple[Any, Any]:
    """The Trainer and device mesh a LightningModule holds, or None, without raising when none is attached (the
    public `trainer` property raises): what a copy of the module must share rather than copy."""
    return getattr(module, "_trainer", None), getattr(module, "_device_mesh", None)
