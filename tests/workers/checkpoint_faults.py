"""Checkpoints under faults, through real Trainers: SIGKILLs at random moments of async saves, a rank that freezes
during a save, a full or read-only disk. The killed and frozen launches are driven from
`tests/launched/test_checkpoint_faults.py`; the cases here say what each rank does and record what it saw.
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_dpar import FullyShardStrategy
from lightning_dpar.checkpoint import writer as checkpoint_writer
from tests.workers.cases import Case, one_case
from tests.workers.checkpoint_common import (
    ResumeModule,
    case_dir,
    error_of,
    gather,
    saved_by,
    train_loader,
    workdir,
)
from tests.workers.common import full_params, trainer_for

STEPS = 12
#: `ModelCheckpoint` settings of the kill cases: save_top_k and save_last, saving every step.
KILL_CONFIGS = {"top1_last": (1, True), "top1_link": (1, "link"), "all_link": (-1, "link"), "top2_last": (2, True)}


def _checkpoint_callback(root: Path, config: str) -> ModelCheckpoint:
    top_k, save_last = KILL_CONFIGS[config]
    return ModelCheckpoint(
        dirpath=root, filename="{step}", every_n_train_steps=1, save_top_k=top_k, monitor="step", mode="max",
        save_last=save_last,
    )  # fmt: skip


class StepMonitor(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.log("step", float(trainer.global_step))


class KillAtRandomMoment(Callback):
    """Rank 0 SIGKILLs itself a random delay after the start of a random async save (seeded per case): the moment
    falls while shards are staged or written, while the finishing step runs, or while training goes on."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        self.save_index = rng.randint(2, STEPS - 3)
        self.delay_s = rng.uniform(0.0, 0.3)
        self.saves = 0

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.saves += 1
        if self.saves == self.save_index and dist.get_rank() == 0:
            timer = threading.Timer(self.delay_s, os.kill, (os.getpid(), signal.SIGKILL))
            timer.daemon = True
            timer.start()


def kill_random_case() -> None:
    """One killed run (configuration and seed from the environment) saving under `case_dir(config)`; never returns
    normally."""
    config, seed = os.environ["DPAR_KILL_CONFIG"], int(os.environ["DPAR_KILL_SEED"])
    callbacks = [StepMonitor(), _checkpoint_callback(case_dir(config), config), KillAtRandomMoment(seed)]
    trainer = trainer_for(
        FullyShardStrategy(async_save=True), max_steps=STEPS, callbacks=callbacks, enable_checkpointing=True
    )
    trainer.fit(ResumeModule(), train_loader())
    time.sleep(5)  # a kill scheduled after the last save still lands


@functools.cache
def _uninterrupted_params() -> dict:
    """The full parameters (on rank 0) of the run the kills interrupted, uninterrupted."""
    reference = trainer_for(FullyShardStrategy(), max_steps=STEPS)
    reference.fit(ResumeModule(), train_loader())
    return full_params(reference)


def resume_after_kill_case(config: str) -> dict:
    """Resume the directory a killed run left with `ckpt_path="last"` and finish; compare with the uninterrupted run."""
    expected = _uninterrupted_params()
    root = saved_by(config)
    names_after_kill = sorted(os.listdir(root))
    module = ResumeModule()
    callbacks = [StepMonitor(), _checkpoint_callback(root, config)]
    trainer = trainer_for(
        FullyShardStrategy(async_save=True), max_steps=STEPS, callbacks=callbacks, enable_checkpointing=True
    )
    trainer.fit(module, train_loader(), ckpt_path="last")
    params = full_params(trainer)
    if dist.get_rank() != 0:
        return None
    return {
        "names_after_kill": names_after_kill,
        "first_step": min(step for step, _ in module.losses) if module.losses else None,
        "max_diff": max((params[k] - expected[k]).abs().max().item() for k in expected),
        "names_at_end": sorted(os.listdir(root)),
    }


def group_resume_after_kills() -> Iterator[Case]:
    for config in KILL_CONFIGS:
        yield Case(f"kill_{config}", lambda config=config: resume_after_kill_case(config))


def last_without_complete_case() -> str | None:
    """A directory holding only interrupted saves: `ckpt_path="last"` refuses instead of starting over."""
    root = case_dir("only_incomplete")
    if dist.get_rank() == 0:
        (root / ".dpar-partial-0123456789-abcd1234").mkdir(parents=True)
        os.symlink("step=7.ckpt", root / "last.ckpt")  # a `save_last="link"` link whose save never completed
    dist.barrier()
    callback = ModelCheckpoint(dirpath=root, save_last="link")
    trainer = trainer_for(FullyShardStrategy(), max_steps=2, callbacks=[callback], enable_checkpointing=True)
    return error_of(lambda: trainer.fit(ResumeModule(), train_loader(), ckpt_path="last"))


# ---------------------------------------------------------------------- a rank that freezes
class FreezeRankOne(Callback):
    """Rank 1 stops (SIGSTOP: alive, unresponsive) inside the second save, after its shards are written."""

    def setup(self, trainer, pl_module, stage):
        original = checkpoint_writer._finish
        count = {"saves": 0}

        def finish(*args, **kwargs):
            count["saves"] += 1
            if count["saves"] == 2 and dist.get_rank() == 1:
                (workdir() / "frozen_at").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
            return original(*args, **kwargs)

        checkpoint_writer._finish = finish


def freeze_case() -> None:
    """Rank 0 records when and how it failed; the test measures it against the freeze and the timeout."""
    timeout_s = float(os.environ["DPAR_FREEZE_TIMEOUT"])
    async_save = os.environ["DPAR_FREEZE_ASYNC"] == "1"
    root = case_dir("freeze")
    (workdir() / f"pid{dist.get_rank() if dist.is_initialized() else os.environ['RANK']}").write_text(str(os.getpid()))
    callback = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    strategy = FullyShardStrategy(async_save=async_save, timeout=timedelta(seconds=timeout_s))
    trainer = trainer_for(strategy, max_steps=STEPS, callbacks=[callback, FreezeRankOne()], enable_checkpointing=True)
    try:
        trainer.fit(ResumeModule(), train_loader())
    except BaseException as error:
        if dist.get_rank() == 0:
            outcome = {"failed_at": time.time(), "error": f"{type(error).__name__}: {error}"}
            (workdir() / "rank0_failure.json").write_text(json.dumps(outcome))
        raise


# ---------------------------------------------------------------------- a full or read-only disk
def disk_full_case(mode: str) -> dict:
    """Saving every step (`mode`: sync or async) onto a small tmpfs of its own (`DPAR_SMALL_DISK/<mode>`, mounted by
    the test) until it is full."""
    root = Path(os.environ["DPAR_SMALL_DISK"]) / mode
    callback = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    strategy = FullyShardStrategy(async_save=mode == "async")
    trainer = trainer_for(strategy, max_steps=40, callbacks=[callback], enable_checkpointing=True)
    error = error_of(lambda: trainer.fit(ResumeModule(hidden=64), train_loader()))
    names = sorted(os.listdir(root))
    complete = [n for n in names if not n.startswith(".")]
    newest = str(root / max(complete, key=_step))  # the newest checkpoint still under a final name loads
    validated = error_of(
        lambda: trainer_for(FullyShardStrategy()).validate(
            ResumeModule(hidden=64), train_loader(), ckpt_path=newest, verbose=False
        )
    )
    return {"errors": gather(error), "names": names, "validated": validated}


def read_only_case() -> list[str | None]:
    root = Path(os.environ["DPAR_READ_ONLY_DISK"]) / "checkpoints"
    trainer = trainer_for(FullyShardStrategy(), max_steps=1)
    trainer.fit(ResumeModule(), train_loader())
    return gather(error_of(lambda: trainer.save_checkpoint(root / "step=1.ckpt")))


def _step(name: str) -> int:
    return int(name.split("=")[1].split(".")[0])


GROUPS = {
    "faults_kill_random": one_case("kill_random", kill_random_case),
    "faults_resume_after_kills": group_resume_after_kills,
    "faults_last_without_complete": one_case("last_without_complete", last_without_complete_case),
    "faults_freeze": one_case("freeze", freeze_case),
    "faults_disk_full": lambda: [
        Case(f"disk_full_{mode}", lambda mode=mode: disk_full_case(mode)) for mode in ("sync", "async")
    ],
    "faults_read_only": one_case("read_only", read_only_case),
}

torch.set_num_threads(1)
