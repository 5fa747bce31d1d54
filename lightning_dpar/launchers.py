"""Launching from an interactive session (notebook, REPL), like Lightning's `ddp_notebook`."""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any

from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lightning_dpar._private_api import MultiProcessingLauncher, WorkerOutput

if TYPE_CHECKING:
    import lightning.pytorch as pl


__all__ = [
    "InteractiveLauncher",
]


class InteractiveLauncher(MultiProcessingLauncher):
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
