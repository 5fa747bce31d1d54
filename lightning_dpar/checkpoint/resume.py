"""Exact resume: what Lightning does not put in a checkpoint and we do — per-rank RNG streams and the position in
the training data within the current epoch.

Lightning already restores the loops' progress (epoch, batch index, global step), optimizers, schedulers and
callbacks, and sets the sampler's epoch. It does not save RNG states, and it repositions a dataloader mid-epoch only
if the loader is stateful; a plain `DataLoader` would restart the epoch from its first batch. We therefore give the
training loader's `DistributedSampler` (the one Lightning inserts) the ability to start an epoch part-way.

The data rule (`checkpoint.data_position`): the training loader's sampler starts an epoch after the samples the
checkpoint says were consumed.

Where `fit` ended. Lightning writes a checkpoint in the `on_train_epoch_end` hook also when `max_steps` stops `fit`
mid-epoch (the example's `save_on_train_epoch_end=True`), and `trainer.save_checkpoint` after `fit` writes the loops
as they are once it returned; in both the epoch counts as processed although only some of its batches were trained.
Lightning's fit loop then starts the next epoch on resume, and the sampler's epoch moves past the saved position.
`align_loop_state` rewrites such a checkpoint's loop progress, before Lightning restores it, into the state a save at
the last trained batch's validation end has: the epoch not yet processed, all of its trained batches complete.
Lightning resumes that state at the next batch of the same epoch (or, after its last batch, with the epoch's end).
A save at the end of an epoch trained whole under `max_epochs` is not rewritten: Lightning starts the next epoch, as
under its DDP, and the epoch's end hooks (callbacks' EMA/SWA updates, checkpoints, early stopping) do not run twice.

RNG streams are restored per rank when the world size is unchanged. After a change of world size there is no
faithful mapping (two ranks must not share a stream), so the freshly seeded streams are kept and a message says so.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.callbacks import Checkpoint, ProgressBar
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_dpar._private_api import unfetched_training_iterator
from lightning_dpar.checkpoint.contents import FORMAT_VERSION
from lightning_dpar.checkpoint.data_position import DataPosition, ResumableDistributedSampler, make_resumable

#: Key of the record holding every rank's RNG streams, in rank order (a list of `capture_rng_state` values).
RNG_STATES_KEY = "rng_states"

__all__ = [
    "RNG_STATES_KEY",
    "ResumeState",
    "align_loop_state",
    "capture_rng_state",
    "restore_rng_state",
    "skip_seen_batches",
    "skipped_plateau_step",
]


# ---------------------------------------------------------------------- Lightning's loop progress
FIT_LOOP_KEY = "fit_loop"
EPOCH_PROGRESS_KEY = "epoch_progress"
BATCH_PROGRESS_KEY = "epoch_loop.batch_progress"


def align_loop_state(checkpoint: dict[str, Any], iteration_based: bool = False) -> tuple[str | None, bool]:
    """Rewrite the fit loop's progress of a checkpoint Lightning would not resume at its next batch into the state it
    does (see the module docstring), before Lightning restores its loops from it. Returns a note when the resume
    cannot be exact even so (else None), and whether the resumed run runs again the end of an epoch whose end hooks
    already ran (a whole epoch under `max_steps`: `announce` names the hooks that repeat).

    Two states are rewritten, both into the state of a save at the validation end of the last trained batch (every
    trained batch complete, the epoch not processed):

    - the epoch's end hooks ran on a partial epoch (the end of `fit` on `max_steps`, a save in `on_train_epoch_end`
      or after `fit` returned), or on a whole epoch under `max_steps` (`iteration_based`): Lightning would count the
      epoch as done and start the next one. A whole epoch's end under `max_epochs` is left alone: Lightning resumes it
      with the next epoch as its DDP does, and running the epoch's end again would repeat its callbacks' hooks (an
      EMA/SWA update, a checkpoint, an early-stopping count);
    - a save in `on_train_batch_end` of the epoch's last batch: Lightning would skip the epoch's end (its hooks, an
      `interval="epoch"` scheduler step, the next epoch's loader start). The validation that follows that batch
      cannot be replayed, so that resume is exact only without one; the note says so.
    """
    loop = checkpoint.get("loops", {}).get(FIT_LOOP_KEY)
    if not isinstance(loop, dict) or EPOCH_PROGRESS_KEY not in loop or BATCH_PROGRESS_KEY not in loop:
        return None, False
    epoch, batches = loop[EPOCH_PROGRESS_KEY], loop[BATCH_PROGRESS_KEY]
    batch, current = batches["current"], epoch["current"]
    trained = batch["processed"] == batch["started"] == batch["ready"] > 0
    whole_epoch = bool(batches.get("is_last_batch"))
    if (
        trained
        and (iteration_based or not whole_epoch)
        and batch["completed"] == batch["processed"]
        and current["ready"] == current["started"] == current["processed"]
    ):
        for tracker in (epoch["current"], epoch["total"]):
            tracker["processed"] = tracker["started"] - 1
            tracker["completed"] = min(tracker["completed"], tracker["processed"])
        return None, whole_epoch
    if (
        trained
        and batch["completed"] == batch["processed"] - 1
        and batches.get("is_last_batch")
        and current["processed"] == current["started"] - 1
    ):
        for tracker in (batch, batches["total"]):
            tracker["completed"] = tracker["processed"]
        return (
            "it was written at the end of the epoch's last batch, before the validation that may follow that batch;"
            " that validation is not run again"
        ), False
    return None, False


# ---------------------------------------------------------------------- RNG
def capture_rng_state() -> dict[str, Any]:
    """This rank's RNG streams (torch CPU and CUDA, Python, NumPy) as weights_only-loadable values."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (np_kind, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_has_gauss, np_gauss),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuples(state["python"]))
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state((np_kind, np_keys.numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _as_tuples(value: Any) -> Any:
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


# ---------------------------------------------------------------------- the resume state of one strategy
class ResumeState:
    """What a loaded checkpoint still has to apply once training starts (RNG streams, data position, batches a
    custom sampler must skip), and the record a save writes. Owned by the checkpoint manager."""

    def __init__(self) -> None:
        self.pending: dict[str, Any] = {}  # the `dpar` record of the checkpoint just loaded for `fit`
        self.train_sampler: ResumableDistributedSampler | None = None
        self.batches_to_skip = 0
        #: Why the loaded checkpoint's loop state cannot resume exactly (from `align_loop_state`), or None.
        self.loop_note: str | None = None
        #: Whether the resumed run runs again the end of an epoch whose end hooks already ran (`align_loop_state`).
        self.reruns_epoch_end = False
        #: The line `position_loader` composed for a mid-epoch resume, logged by `announce` once the loop is set.
        self.announcement: tuple[str, bool] | None = None

    @property
    def mid_epoch(self) -> bool:
        """Whether the checkpoint just loaded for `fit` was saved in the middle of an epoch."""
        return self.pending.get("epoch_batches", {}).get("batches", 0) > 0

    def record(self, trainer: Any, strategy_name: str, world_size: int, data_parallel_size: int | None) -> dict:
        """Our part of a checkpoint's metadata: layout and the data position. Local, no collective: every rank's RNG
        streams (`RNG_STATES_KEY`) join the record on the way to disk, carried by a collective the save performs
        anyway (see `CheckpointManager.save`)."""
        record: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "strategy": strategy_name,
            "world_size": world_size,
        }
        if trainer is not None and data_parallel_size is not None:
            batches = trainer.fit_loop.epoch_loop.batch_progress.current.processed
            # The epoch these batches belong to: the last one started (`current_epoch` has moved on after `fit`).
            epoch = max(trainer.fit_loop.epoch_progress.current.started - 1, 0)
            record["epoch_batches"] = {
                "epoch": epoch,
                "batches": batches,
                "data_parallel_size": data_parallel_size,
            }
            if self.train_sampler is not None:
                record["data_position"] = self.train_sampler.position(batches).as_dict()
        return record

    def position_loader(self, dataloader: object, data_parallel_size: int | None) -> tuple[str, bool]:
        """Make the training loader resumable mid-epoch and position it where the loaded checkpoint left off.
        Returns one line saying how the epoch resumes, and whether the resume is exact."""
        self.train_sampler = make_resumable(dataloader)
        position = self.pending.get("data_position")
        seen = self.pending.get("epoch_batches", {})
        epoch, batches = seen.get("epoch", 0), seen.get("batches", 0)
        same_size = seen.get("data_parallel_size") == data_parallel_size
        if self.train_sampler is not None and position is not None:
            self.train_sampler.start_at(DataPosition(**position))
            if same_size:
                return (
                    f"Resuming epoch {epoch} after {batches} batches: exact (the distributed sampler continues from"
                    " the checkpoint's position).",
                    True,
                )
            return (
                f"Resuming epoch {epoch} after {batches} batches: not the same batches, because the data-parallel size"
                f" changed from {seen.get('data_parallel_size')} to {data_parallel_size}; every remaining sample of"
                " the epoch is still seen once.",
                True,
            )
        if batches > 0 and same_size:
            self.batches_to_skip = batches  # a custom sampler: replay and drop them in `skip_seen_batches`
            return f"Resuming epoch {epoch} after {batches} batches (custom sampler).", True
        return (
            "Resuming not exactly: the checkpoint was saved mid-epoch with another data-parallel size, and the"
            " training loader has a custom sampler or batch sampler, whose position cannot be mapped: this epoch"
            " restarts from its first batch. Use a plain `DataLoader(dataset, batch_size=...)` (Lightning adds the"
            " distributed sampler).",
            False,
        )

    def announce(self, trainer: Any) -> None:
        """Log how this mid-epoch resume goes, once Lightning's loop has restored its progress (in `on_train_start`):
        exact only if the loop continues in the epoch the data position belongs to, and nothing it skips is lost."""
        announcement, self.announcement = self.announcement, None
        note, self.loop_note = self.loop_note, None
        reruns, self.reruns_epoch_end = self.reruns_epoch_end, False
        if announcement is None:
            return
        how, exact = announcement
        position = self.train_sampler._start if self.train_sampler is not None else None
        lightning_epoch = trainer.fit_loop.epoch_progress.current.processed  # the epoch its sampler is set to
        ended = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch  # the checkpoint's epoch was trained whole
        if exact and position is not None and ended and lightning_epoch == position.epoch + 1:
            how = (
                f"Resuming at the start of epoch {lightning_epoch}: exact (the checkpoint was written at the end of"
                f" epoch {position.epoch})."
            )
        elif exact and position is not None and position.epoch != lightning_epoch:
            how, exact = (
                f"Resuming not exactly: the checkpoint is in epoch {position.epoch} after {position.batches} batches,"
                f" but Lightning's loop continues in epoch {lightning_epoch}, so the rest of epoch {position.epoch}"
                " is not trained and the batches differ from an uninterrupted run's.",
                False,
            )
        if exact and note is not None and trainer.enable_validation:
            how, exact = f"Resuming not exactly: {note}.", False
        repeated = repeated_epoch_end_hooks(trainer) if reruns else []
        if exact and repeated:
            how, exact = (
                f"Resuming not exactly: the checkpoint was written at the end of epoch {lightning_epoch} under"
                " `max_steps`, and Lightning's loop runs that epoch's end again, so the `on_train_epoch_end` hooks of"
                f" {', '.join(repeated)} run a second time.",
                False,
            )
        plateau = skipped_plateau_step(trainer)
        if exact and plateau is not None:
            how, exact = f"Resuming not exactly: {plateau}.", False
        if exact:
            rank_zero_info(how)
        else:
            rank_zero_warn(how)

    def restore_rng(self, world_size: int, global_rank: int) -> str | None:
        """Restore this rank's RNG streams; returns a note when they cannot be mapped to this world size."""
        states = self.pending.get(RNG_STATES_KEY)
        self.pending = {}
        if states is not None and len(states) == world_size:
            restore_rng_state(states[global_rank])
        elif states is not None:
            return (
                f"The checkpoint was saved by {len(states)} ranks and is resumed on {world_size}; the per-rank RNG"
                " streams cannot be mapped, so the freshly seeded ones are used."
            )
        return None


def repeated_epoch_end_hooks(trainer: Any) -> list[str]:
    """The callbacks and LightningModule whose own `on_train_epoch_end` would run twice if an epoch's end ran again.
    Checkpoint callbacks (a second save of the same state) and progress bars (display only) change no training."""
    owners = [
        callback
        for callback in trainer.callbacks
        if not isinstance(callback, (Checkpoint, ProgressBar))
        and is_overridden("on_train_epoch_end", callback, Callback)
    ]
    names = [type(callback).__name__ for callback in owners]
    if is_overridden("on_train_epoch_end", trainer.lightning_module, LightningModule):
        names.append(type(trainer.lightning_module).__name__)
    return names


def skipped_plateau_step(trainer: Any) -> str | None:
    """Why the resumed run's LR can differ from the uninterrupted run's because of an `interval="epoch"`
    `ReduceLROnPlateau`, or None.

    Lightning steps such a scheduler in `fit_loop.on_advance_end`, after the epoch's `on_train_epoch_end` hooks (so
    after any save in them, at validation end or mid-epoch), except while its fit loop is restarting: the monitored
    metric is not in the checkpoint, and in a resumed epoch it is not the uninterrupted run's (validation before the
    save is not repeated, epoch-aggregated training metrics cover only the resumed batches). The resumed epoch's end
    therefore does not step it where the uninterrupted run did (under Lightning's DDP as well); stepping it here
    instead would need the metric the uninterrupted run had, which no checkpoint holds."""
    loop = trainer.fit_loop
    if not trainer.lightning_module.automatic_optimization:
        return None
    if loop.restarting:
        epoch = loop.epoch_progress.current.processed  # the epoch whose end comes next
    elif loop.resumed_on_epoch_end:
        epoch = loop.epoch_progress.current.processed - 1  # saved in its end hooks; Lightning moves on to the next
    else:
        return None
    due = [
        config
        for config in trainer.lr_scheduler_configs
        if config.reduce_on_plateau and config.interval == "epoch" and (epoch + 1) % config.frequency == 0
    ]
    if not due:
        return None
    return (
        f'Lightning does not step the `interval="epoch"` `{type(due[0].scheduler).__name__}` (monitoring'
        f" {due[0].monitor!r}) at the end of epoch {epoch}, where this fit resumes, because the metric it"
        " monitors is not in the checkpoint; the uninterrupted run steps it there, so from that epoch on the"
        " learning rate can differ. Only a scheduler that monitors no metric resumes exactly"
    )


def skip_seen_batches(state: ResumeState, trainer: Any) -> None:
    """Custom samplers cannot start mid-epoch: draw and drop the batches this epoch already trained on."""
    skip, state.batches_to_skip = state.batches_to_skip, 0
    if not skip:
        return
    restored = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    if restored != skip or skip >= trainer.num_training_batches:
        return  # not resuming inside the epoch the checkpoint was taken in (e.g. saved at its end)
    iterator = unfetched_training_iterator(trainer)
    if iterator is None:
        rank_zero_warn(
            f"Resuming not exactly: could not skip the {skip} batches already seen this epoch; the epoch restarts."
        )
        return
    plateau = skipped_plateau_step(trainer)
    if plateau is not None:
        rank_zero_warn(f"Resuming after {skip} batches of this epoch not exactly: {plateau}.")
    else:
        rank_zero_info(
            f"Resuming after {skip} batches of this epoch: exact (the custom sampler's batches seen before the"
            " checkpoint are drawn again and skipped)."
        )
    for _ in range(skip):
        next(iterator, None)
