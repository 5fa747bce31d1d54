"""Launching the ranks, and what must happen before Lightning resolves `ckpt_path`.

- `InteractiveLauncher`: forks the ranks from a notebook or REPL, like Lightning's `ddp_notebook`.
- `ScriptLauncher`: re-runs the script once per rank, like Lightning's DDP strategies.
- `InPlaceLauncher`: processes started by torchrun, SLURM or the script launcher: runs the Trainer function here.

All three resolve `ckpt_path="last"` to the newest complete checkpoint first (`checkpoint.discovery`).
"""

from __future__ import annotations

import inspect
import os
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lightning_dpar._private_api import (
    Launcher,
    MultiProcessingLauncher,
    SubprocessScriptLauncher,
    WorkerOutput,
    model_checkpoint_dir,
)
from lightning_dpar.checkpoint.discovery import resolve_last
from lightning_dpar.checkpoint.storage import Location

if TYPE_CHECKING:
    import lightning.pytorch as pl


__all__ = [
    "InPlaceLauncher",
    "InteractiveLauncher",
    "ScriptLauncher",
    "resolve_last_checkpoint_argument",
]


def resolve_last_checkpoint_argument(
    function: Callable[..., Any], args: tuple, kwargs: dict[str, Any], trainer: pl.Trainer | None
) -> tuple[tuple, dict[str, Any]]:
    """Replace `ckpt_path="last"` among the arguments of a Trainer function (`_fit_impl`, `_validate_impl`, ...) by
    the newest complete checkpoint of the trainer's `ModelCheckpoint` directories, and log which one."""
    try:
        bound = inspect.signature(function).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    if trainer is None or bound.arguments.get("ckpt_path") != "last":
        return args, kwargs
    directories = [
        Location.parse(directory)
        for callback in trainer.checkpoint_callbacks
        if isinstance(callback, ModelCheckpoint) and (directory := model_checkpoint_dir(callback, trainer))
    ]
    path, reason = resolve_last(directories)
    if path is None:
        return args, kwargs  # nothing saved yet: Lightning starts from scratch, as it documents
    rank_zero_info(f"`ckpt_path='last'` resolves to {path!r}: {reason}.")
    bound.arguments["ckpt_path"] = path
    return bound.args, bound.kwargs


class _ResolvesLastCheckpoint:
    """Mixin for launchers: resolve `ckpt_path="last"` before the Trainer function runs."""

    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        args, kwargs = resolve_last_checkpoint_argument(function, args, kwargs, trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]


class ScriptLauncher(_ResolvesLastCheckpoint, SubprocessScriptLauncher):
    """Lightning's script launcher (one process per rank re-running the script)."""


class InPlaceLauncher(_ResolvesLastCheckpoint, Launcher):
    """The processes already exist (torchrun, SLURM, or a rank the script launcher started): run here."""

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        args, kwargs = resolve_last_checkpoint_argument(function, args, kwargs, trainer)
        return function(*args, **kwargs)

    def kill(self, signum: Any) -> None:
        """Nothing to kill: this launcher started no process."""


class InteractiveLauncher(_ResolvesLastCheckpoint, MultiProcessingLauncher):
    """Forks the ranks from the current process and hands the trained weights back to it.

    Lightning's launcher sends back `lightning_module.state_dict()` from rank 0, which for a sharded model holds
    only rank 0's shards; here every rank joins a gather so the notebook's module receives the full weights.
    """

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> WorkerOutput | None:
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state_dict = get_model_state_dict(trainer.lightning_module, options=options)  # collective: all ranks
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        return WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))
