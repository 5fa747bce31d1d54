"""Lightning's checkpoint hooks, as one mixin of `DparStrategy`: save, load, removal of superseded checkpoints, the
`save_last="link"` link, the model and optimizer state-dict hooks, background saves, and the resume state restored
when training starts. Each hook delegates to the strategy's `CheckpointManager` (`lightning_dpar.checkpoint.manager`),
the single owner of everything about checkpoints."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dpar.checkpoint.hf_export import hf_model_record
from lightning_dpar.checkpoint.peft_export import peft_model_record
from lightning_dpar.helpers import attached_trainer

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_dpar.checkpoint.manager import CheckpointManager
    from lightning_dpar.conformance.buffers import BufferSync
    from lightning_dpar.parallel_dims import ParallelDims
    from lightning_dpar.plan import ModulePlan

__all__ = ["CheckpointHooks"]


class CheckpointHooks(ParallelStrategy):
    """The checkpoint hooks of `DparStrategy`, which sets the state they read (in its `__init__` and `setup`)."""

    #: The single owner of save, load, async writes, removal and the resume state.
    checkpoints: CheckpointManager
    dims: ParallelDims | None
    _buffer_sync: BufferSync | None
    #: The model's tied parameters, found before parallelism (`ModulePlan.tied`), for the pretrained load.
    plan: ModulePlan | None

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # shards can only be loaded into the wrapped model

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # `load_checkpoint` loads optimizer shards itself

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state to save; its unsharded buffers are rank 0's (of each data-parallel group), as in a DDP
        checkpoint, whichever rank writes them."""
        assert self.model is not None
        return self.model_checkpoint_state(self.model)

    def model_checkpoint_state(self, model: nn.Module) -> dict[str, Any]:
        """`model`'s state as a checkpoint holds it (shards, or gathered with `checkpoint_format="full"`), with rank
        0's unsharded buffers; the Trainer's hook and Fabric's save (`lightning_dpar.fabric`) both write this."""
        state = self.checkpoints.model_state(model)
        return self._buffer_sync.first_rank_copies(state) if self._buffer_sync is not None else state

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.model is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        return self.checkpoints.optimizer_state(self.model, optimizer)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # done by `load_checkpoint`, which has the wrapped model

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # done by `load_checkpoint`

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Sharded: every rank writes its shards (atomically; in the background with `async_save`). Full: rank 0
        writes one file. See `docs/checkpointing.md`."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take `storage_options`.")
        assert self.lightning_module is not None
        self.write_checkpoint(checkpoint, filepath, attached_trainer(self.lightning_module), self.lightning_module)

    def write_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, trainer: Any, module: nn.Module) -> None:
        """Write `checkpoint` (Lightning's layout: `state_dict`, `optimizer_states`, the rest) of `module` through
        the checkpoint manager, with our record (layout; the data position when `trainer` is given) and what
        `consolidate --format hf`/`peft` need; collective. The Trainer's save and Fabric's (`lightning_dpar.fabric`)
        both end here, so their checkpoints are the same."""
        record = self.checkpoints.record(trainer, type(self).__name__, self.world_size, self.sampler_shards())
        checkpoint.update(hf_model_record(module))  # for `consolidate --format hf`
        checkpoint.update(peft_model_record(module))  # for `consolidate --format peft`
        self.checkpoints.save(checkpoint, filepath, record)

    def _point_last_link(self, trainer: pl.Trainer, filepath: str, linkpath: str) -> None:
        """`ModelCheckpoint(save_last="link")`'s link, made only once the checkpoint it names is published."""
        if not self.checkpoints.link(filepath, linkpath, trainer.is_global_zero):
            self.barrier()  # as Lightning's: no rank reads the link before rank 0 made it

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Called by `ModelCheckpoint` for superseded checkpoints; kept until a save in flight is complete."""
        self.checkpoints.remove(filepath, self.is_global_zero)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load model (and, when fitting, optimizer) state in place, resharding to this layout; return the rest.
        A bad path or file raises the same `CheckpointLoadError` on every rank instead of hanging."""
        assert self.model is not None and self.lightning_module is not None
        trainer = self.lightning_module.trainer
        fitting = trainer.state.fn == TrainerFn.FITTING
        return self.checkpoints.load(
            checkpoint_path,
            self.model,
            self.optimizers if fitting else [],
            self.lightning_module.strict_loading,
            fitting,
            iteration_based=trainer.max_steps != -1,
            tied=self.plan.tied if self.plan is not None else (),
        )

    @override
    def on_train_start(self) -> None:
        """Restore this rank's RNG streams right before training continues (after loaders and sanity checks)."""
        trainer = attached_trainer(self.lightning_module)
        note = self.checkpoints.start_training(trainer, self.world_size, self.global_rank)
        if note is not None:
            rank_zero_info(note)

    @property
    def async_save(self) -> bool:
        """Whether sharded saves are written in the background. Settable between saves, e.g. to `False` before a
        final save that must be on disk when `save_checkpoint` returns."""
        return self.checkpoints.async_save

    @async_save.setter
    def async_save(self, enabled: bool) -> None:
        self.checkpoints.async_save = enabled

    def wait_for_checkpoint(self) -> None:
        """Block until an `async_save` checkpoint still being written is complete under its final name.

        The next save, a load and the end of `fit` already wait; call this after your own
        `trainer.save_checkpoint(...)` if you read or copy the checkpoint before any of those happens.
        """
        self.checkpoints.wait()
        self.barrier()

    @override
    def on_train_end(self) -> None:
        """The end of `fit` waits for the last background save, so its checkpoint is complete on return."""
        self.wait_for_checkpoint()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """After an error, wait a bounded time for a background save and log how it ended (teardown follows)."""
        self.checkpoints.close()
