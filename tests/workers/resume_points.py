"""Cases for `tests/launched/test_resume_points.py`: exact resume from every kind of save. One 10-step run (4
batches an epoch, validation every 2) saves every 4 steps, at validation end on a monitored metric and at each
epoch's end; other checkpoints are written at the end of `fit`, by `trainer.save_checkpoint` and by
`save_on_exception`; each case resumes from one of them and compares every rank's batches, learning rates, final
state and resume log with the uninterrupted run.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dpar import FullyShardStrategy
from tests.workers.cases import Case
from tests.workers.checkpoint_common import (
    IndexedData,
    ResumeModule,
    case_dir,
    error_of,
    flat_tensors,
    full_optimizer,
    gather,
    max_diff,
    val_loader,
)
from tests.workers.common import BATCH, full_params, trainer_for

#: 32 samples / batch 4 / 2 data-parallel ranks: 4 batches an epoch, so 10 steps cross two epoch ends.
POINTS_SAMPLES, POINTS_STEPS = 32, 10


def points_loader() -> torch.utils.data.DataLoader:
    """Shuffled (Lightning's sampler then shuffles per epoch): a wrong epoch or position shows in the batches."""
    return torch.utils.data.DataLoader(IndexedData(n=POINTS_SAMPLES), batch_size=BATCH, shuffle=True)


class PointsModule(ResumeModule):
    """`ResumeModule` (a per-step `StepLR`) with an `interval="epoch"` `StepLR` on top, and with `plateau` also an
    epoch-interval `ReduceLROnPlateau` on a constant metric (it halves the LR at the second epoch end it sees), so
    that a scheduler step lost or doubled at a resume shows in the LR and the weights. Records the LR of each step."""

    def __init__(self, plateau: bool = False) -> None:
        super().__init__()
        self.plateau = plateau
        self.lrs: list[float] = []

    def training_step(self, batch, batch_idx):
        self.lrs.append(self.optimizers().param_groups[0]["lr"])
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        if self.plateau:
            self.log("plateau_metric", 1.0)

    def configure_optimizers(self):
        config = super().configure_optimizers()
        optimizer = config["optimizer"]
        epochly = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
        schedulers = [config["lr_scheduler"], {"scheduler": epochly, "interval": "epoch"}]
        if self.plateau:
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
            schedulers.append({"scheduler": plateau, "interval": "epoch", "monitor": "plateau_metric"})
        return [optimizer], schedulers


class RaisesAtStep(PointsModule):
    """Raises in `training_step` at `raise_at` (before training on that batch), as a crash would."""

    def __init__(self, raise_at: int) -> None:
        super().__init__()
        self.raise_at = raise_at

    def training_step(self, batch, batch_idx):
        if self.global_step == self.raise_at:
            raise RuntimeError(f"crash at step {self.raise_at}")
        return super().training_step(batch, batch_idx)


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _points_fit(module, max_steps: int, callbacks=(), ckpt_path=None) -> tuple[object, list[str]]:
    """Fit `module` on the points data with validation every 2 batches; the Trainer and rank 0's resume lines."""
    trainer = trainer_for(
        FullyShardStrategy(),
        max_steps=max_steps,
        callbacks=list(callbacks),
        enable_checkpointing=bool(callbacks),
        val_check_interval=2,
        limit_val_batches=1,
    )
    records = _Messages()
    logging.getLogger("lightning.pytorch").addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, points_loader(), val_loader(), ckpt_path=ckpt_path)
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(records)
    lines = records.messages + [str(w.message) for w in caught]
    return trainer, [line for line in lines if "Resuming" in line or "resume" in line.lower()]


def _steps(module) -> list[list]:
    """(global step, loss, sample indices, LR) of every batch `module` trained on, on this rank."""
    return [
        [step, loss, module.seen[i * BATCH : (i + 1) * BATCH], module.lrs[i]]
        for i, (step, loss) in enumerate(module.losses)
    ]


def _final_state(trainer) -> dict[str, torch.Tensor]:
    params = full_params(trainer)
    optimizer = flat_tensors("optimizer", full_optimizer(trainer).get("state", {}))  # on rank 0 only
    return {**{f"model.{k}": v for k, v in params.items()}, **optimizer}


@functools.cache
def _points_reference(plateau: bool = False) -> tuple[list[list], list[list], dict[str, torch.Tensor]]:
    """The uninterrupted run (every rank's batches, and the final state on rank 0), saving along the way: every 4
    steps, at validation end on a monitored metric, and at each epoch's end."""
    root = case_dir("points_plateau" if plateau else "points")
    callbacks = [
        ModelCheckpoint(dirpath=root / "every", filename="{step}", every_n_train_steps=4, save_top_k=-1),
        ModelCheckpoint(dirpath=root / "monitor", filename="{step}", monitor="val_loss", save_top_k=-1),
        ModelCheckpoint(
            dirpath=root / "epoch", filename="{step}", every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True
        ),
    ]
    module = PointsModule(plateau)
    trainer, _ = _points_fit(module, POINTS_STEPS, callbacks)
    return gather(_steps(module)), _final_state(trainer)


def _resume_point(written: str, plateau: bool) -> tuple[int, str]:
    """Write the checkpoint the way `written` names (or find the reference run's); its global step and path."""
    root = case_dir("points_plateau" if plateau else "points")
    if written.startswith(("every/", "monitor/", "epoch/")):
        _points_reference(plateau)
        return int(written.split("step=")[1].split(".")[0]), str(root / written)
    directory = root / written
    if written in ("fit_end_mid_epoch", "fit_end_epoch_end"):  # the README's flow: `fit` ends on `max_steps`
        steps = 3 if written == "fit_end_mid_epoch" else 4
        callback = ModelCheckpoint(dirpath=directory, save_last="link", save_on_train_epoch_end=True)
        _points_fit(PointsModule(plateau), steps, [callback])
        return steps, str(directory / "last.ckpt")
    if written == "save_checkpoint_after_fit":
        trainer, _ = _points_fit(PointsModule(plateau), 3)
        trainer.save_checkpoint(directory / "saved.ckpt")
        return 3, str(directory / "saved.ckpt")
    if written == "exception":
        callback = ModelCheckpoint(dirpath=directory, filename="crash", save_on_exception=True, save_top_k=0)
        error = error_of(lambda: _points_fit(RaisesAtStep(3), POINTS_STEPS, [callback]))
        assert error is not None and "crash at step 3" in error, error
        return 3, str(directory / "crash.ckpt")
    raise ValueError(written)


def resume_point_case(written: str) -> dict:
    """Resume from a checkpoint written the way `written` names (`plateau/<way>`: with the plateau scheduler) and
    train to the reference run's last step: every rank's batches (step, loss, samples, LR), the final weights and
    optimizer state, and what the log said."""
    plateau = written.startswith("plateau/")
    written = written.removeprefix("plateau/")
    reference_steps, reference_state = _points_reference(plateau)
    step, path = _resume_point(written, plateau)
    module = PointsModule(plateau)
    trainer, lines = _points_fit(module, POINTS_STEPS, ckpt_path=path)
    resumed_steps, state = gather(_steps(module)), _final_state(trainer)
    expected = [[entry for entry in rank_steps if entry[0] >= step] for rank_steps in reference_steps]
    if dist.get_rank() != 0:
        return None
    return {
        "same_batches": resumed_steps == expected,
        "resumed_batches": [entry[::2] for entry in resumed_steps[0]],
        "expected_batches": [entry[::2] for entry in expected[0]],
        "resumed_lrs": [entry[3] for entry in resumed_steps[0]],
        "expected_lrs": [entry[3] for entry in expected[0]],
        "state_max_diff": max_diff(state, reference_state),
        "lines": lines,
    }


RESUME_POINTS = [
    "every/step=4.ckpt",
    "monitor/step=2.ckpt",
    "monitor/step=4.ckpt",
    "epoch/step=4.ckpt",
    "fit_end_mid_epoch",
    "fit_end_epoch_end",
    "save_checkpoint_after_fit",
    "exception",
    "plateau/monitor/step=2.ckpt",
    "plateau/epoch/step=4.ckpt",
    "plateau/fit_end_epoch_end",
]


def group_resume_points() -> Iterator[Case]:
    for written in RESUME_POINTS:
        yield Case(f"resume_point_{written}", lambda written=written: resume_point_case(written))


GROUPS = {"resume_points": group_resume_points}
