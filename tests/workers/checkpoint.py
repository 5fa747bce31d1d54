"""Cases for `tests/launched/test_checkpoint.py`: Lightning's checkpoint flow through real Trainers (ModelCheckpoint,
save/load, `ckpt_path="last"`), resume (from every kind of save: `resume_points.py`), strict loading and bad input,
and a kill during a save.

The kill case never ends normally (its test drives it with torchrun and expects the SIGKILL); the after-kill cases
load what it left, in the directory the test's fixture passes (`checkpoint_common.saved_by`).
"""

from __future__ import annotations

import functools
import os
import random
import signal
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_dpar import FullyShardStrategy
from lightning_dpar.checkpoint import writer as checkpoint_writer
from lightning_dpar.checkpoint.contents import inspect_checkpoint, is_complete_checkpoint
from lightning_dpar.checkpoint.resume import capture_rng_state
from lightning_dpar.checkpoint.storage import Location
from tests.support.checkpoint_files import write_damaged_copies
from tests.workers.cases import Case, one_case
from tests.workers.checkpoint_common import (
    ResumeModule,
    ReversedSampler,
    case_dir,
    error_of,
    gather,
    same_streams,
    saved_by,
    strategy_for,
    train_loader,
    val_loader,
)
from tests.workers.common import full_params, trainer_for


# ---------------------------------------------------------------------- Lightning's flow + exact resume
def resume_case(name: str, strategy: str, sampler=None, **strategy_kwargs) -> dict:
    """Full run with a checkpoint every 5 steps; resume from step 5 (mid-epoch 0, epoch 1 follows) in a new Trainer."""
    root = case_dir(f"resume_{name}")
    steps = 20  # 16 batches per epoch on 2 data-parallel ranks, 32 on one
    every = ModelCheckpoint(dirpath=root / "every", filename="{step}", every_n_train_steps=5, save_top_k=-1)
    top = ModelCheckpoint(
        dirpath=root / "top",
        filename="{step}",
        every_n_train_steps=5,
        save_top_k=2,
        monitor="val_loss",
        save_last=True,
    )
    full_run = ResumeModule()
    trainer = trainer_for(
        strategy_for(strategy, **strategy_kwargs),
        max_steps=steps,
        callbacks=[every, top],
        val_check_interval=5,
        enable_checkpointing=True,
    )
    trainer.fit(full_run, train_loader(sampler), val_loader())
    val_after_fit = trainer.validate(full_run, val_loader(), verbose=False)[0]["val_loss"]

    resumed = ResumeModule()
    trainer2 = trainer_for(
        strategy_for(strategy), max_steps=steps, val_check_interval=5, callbacks=[], enable_checkpointing=False
    )
    trainer2.fit(resumed, train_loader(sampler), val_loader(), ckpt_path=str(root / "every" / "step=5.ckpt"))

    evaluator = ResumeModule()
    trainer3 = trainer_for(strategy_for(strategy))
    val_from_last = trainer3.validate(evaluator, val_loader(), ckpt_path=str(root / "top" / "last.ckpt"), verbose=False)
    test_error = error_of(lambda: trainer3.validate(evaluator, val_loader(), ckpt_path=str(root / "top" / "nope.ckpt")))

    full_losses, resumed_losses = gather(full_run.losses), gather(resumed.losses)
    return {
        "full_after_5": [[loss for step, loss in losses if step >= 5] for losses in full_losses],
        "resumed": [[loss for _, loss in losses] for losses in resumed_losses],
        "resumed_first_step": min(step for step, _ in resumed_losses[0]),
        "every_dir": sorted(os.listdir(root / "every")),
        "top_dir": sorted(os.listdir(root / "top")),
        "best_k": sorted(Path(p).name for p in top.best_k_models),
        "last_model_path": Path(top.last_model_path).name,
        "val_after_fit": val_after_fit,
        "val_from_last": val_from_last[0]["val_loss"],
        "missing_ckpt_error": test_error,
    }


def group_resume() -> Iterator[Case]:
    yield Case("resume_fsdp", lambda: resume_case("fsdp", "fsdp"))
    yield Case("resume_replicate", lambda: resume_case("replicate", "replicate"))
    yield Case("resume_2d", lambda: resume_case("2d", "2d"))
    yield Case("resume_fsdp_async", lambda: resume_case("fsdp_async", "fsdp", async_save=True))
    yield Case("resume_fsdp_full", lambda: resume_case("fsdp_full", "fsdp", checkpoint_format="full"))
    yield Case(
        "resume_fsdp_custom_sampler", lambda: resume_case("fsdp_custom_sampler", "fsdp", sampler=ReversedSampler(128))
    )
    yield Case("async_rng_record", async_rng_record_case)
    yield Case("async_link", async_link_case)


def resume_last_case() -> dict:
    """`fit(ckpt_path="last")` finds `last.ckpt` through ModelCheckpoint and continues from its step."""
    root = case_dir("resume_last")
    callback = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=3, save_last=True)
    module = ResumeModule()
    trainer = trainer_for(FullyShardStrategy(), max_steps=6, callbacks=[callback], enable_checkpointing=True)
    trainer.fit(module, train_loader())
    callback2 = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=3, save_last=True)
    module2 = ResumeModule()
    trainer2 = trainer_for(FullyShardStrategy(), max_steps=9, callbacks=[callback2], enable_checkpointing=True)
    trainer2.fit(module2, train_loader(), ckpt_path="last")
    return {
        "first_step": min(step for step, _ in module2.losses),
        "final_step": trainer2.global_step,
        "dir": sorted(os.listdir(root)),
    }


# ---------------------------------------------------------------------- every rank's RNG streams, async
class RngAtFirstBatch(Callback):
    """This rank's RNG streams when the resumed run's first batch starts: after the strategy restored them, before
    any training step draws from them (the run resumes mid-epoch, so no epoch start comes first)."""

    def __init__(self) -> None:
        self.state = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.state is None:
            self.state = capture_rng_state()


def async_rng_record_case() -> dict:
    """An async save writes every rank's RNG streams into `meta.pt`, in rank order, with no collective in front of
    the save: rank 1's `save_checkpoint` returns while rank 0 has not started its own (a collective would block it
    until rank 0 joins). Resuming from it restores each rank's own streams."""
    root = case_dir("async_rng_record")
    root.mkdir(parents=True, exist_ok=True)
    trainer = trainer_for(FullyShardStrategy(async_save=True), max_steps=2)
    trainer.fit(ResumeModule(), train_loader())
    rank = dist.get_rank()
    trainer.save_checkpoint(root / "first.ckpt")  # the first async save also creates the writer's process group
    trainer.strategy.wait_for_checkpoint()
    torch.rand(rank + 1), [random.random() for _ in range(rank + 1)], np.random.rand(rank + 1)  # ranks' streams differ
    expected = capture_rng_state()
    path, returned = root / "second.ckpt", root / "rank1_returned"
    rank1_returned_first = True
    if rank == 1:
        trainer.save_checkpoint(path)
        returned.touch()
    else:
        deadline = time.monotonic() + 20
        while not returned.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        rank1_returned_first = returned.exists()
        trainer.save_checkpoint(path)
    trainer.strategy.wait_for_checkpoint()
    recorded = inspect_checkpoint(Location.parse(path)).dpar_record["rng_states"]
    probe = RngAtFirstBatch()
    resumed = trainer_for(FullyShardStrategy(), max_steps=3, callbacks=[probe])
    resumed.fit(ResumeModule(), train_loader(), ckpt_path=str(path))
    every_expected, every_restored = gather(expected), gather(probe.state)
    return {
        "rank1_returned_first": rank1_returned_first,
        "ranks_differ": not same_streams(every_expected[0], every_expected[1]),
        "recorded_ranks": len(recorded),
        "recorded_matches": [same_streams(r, e) for r, e in zip(recorded, every_expected)],
        "restored_matches": [same_streams(r, e) for r, e in zip(every_restored, every_expected)],
    }


# ---------------------------------------------------------------------- save_last="link" with async saves
class SlowSecondSave(Callback):
    """Holds the background finishing step of the second save for 2 s and, when the next batch starts (the save
    still in flight), records on rank 0 where `last.ckpt` points and whether that is a complete checkpoint: what a
    kill at that moment would leave."""

    def __init__(self, last: Path) -> None:
        self.last, self.seen = last, None
        self.original = checkpoint_writer._finish
        self.saves = 0

    def setup(self, trainer, pl_module, stage):
        def finish(*args, **kwargs):
            self.saves += 1
            if self.saves == 2:
                time.sleep(2.0)
            return self.original(*args, **kwargs)

        checkpoint_writer._finish = finish

    def teardown(self, trainer, pl_module, stage):
        checkpoint_writer._finish = self.original

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 2 and trainer.is_global_zero:
            target = os.readlink(self.last) if os.path.islink(self.last) else None
            self.seen = {"target": target, "complete": is_complete_checkpoint(Location.parse(str(self.last)))}


def async_link_case() -> dict:
    """`save_last="link"` with `async_save=True`: while a save is being written, `last.ckpt` still names the
    previous complete checkpoint; once it is published, the new one. An explicit `ckpt_path=".../last.ckpt"` loads."""
    root = case_dir("async_link")
    callback = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=1, save_top_k=-1, save_last="link")
    probe = SlowSecondSave(root / "last.ckpt")
    trainer = trainer_for(
        FullyShardStrategy(async_save=True), max_steps=3, callbacks=[callback, probe], enable_checkpointing=True
    )
    trainer.fit(ResumeModule(), train_loader())
    after_fit = os.readlink(root / "last.ckpt") if dist.get_rank() == 0 else None
    module = ResumeModule()
    trainer_for(FullyShardStrategy(), max_steps=4).fit(module, train_loader(), ckpt_path=str(root / "last.ckpt"))
    return {"while_in_flight": probe.seen, "after_fit": after_fit, "resumed_first_step": module.losses[0][0]}


# ---------------------------------------------------------------------- strict loading and bad input
class Lenient(ResumeModule):
    strict_loading = False


def _validate(ckpt, make=ResumeModule, **kwargs):
    evaluator = make(**kwargs)
    trainer = trainer_for(FullyShardStrategy())
    trainer.validate(evaluator, val_loader(), ckpt_path=str(ckpt), verbose=False)
    return trainer


def _lenient_warning(ckpt, **kwargs) -> tuple[object, str | None]:
    """Validate `Lenient(**kwargs)` from `ckpt`; its Trainer and the `strict_loading=False` warning it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _validate(ckpt, Lenient, **kwargs)
    return trainer, next((str(w.message) for w in caught if "strict_loading=False" in str(w.message)), None)


@functools.cache
def _bad_input_files() -> tuple[Path, Path, dict]:
    """A 2-step checkpoint (`good.ckpt`), its full params (on rank 0), and damaged or foreign copies of it."""
    root = case_dir("bad_input")
    trainer = trainer_for(FullyShardStrategy(), max_steps=2)
    trainer.fit(ResumeModule(), train_loader())
    good = root / "good.ckpt"
    trainer.save_checkpoint(good)
    reference = full_params(trainer)
    if dist.get_rank() == 0:
        (root / "not_a_checkpoint").mkdir(exist_ok=True)  # exists when a relaunch reruns this
        (root / "not_a_checkpoint" / "notes.txt").write_text("hi")
        write_damaged_copies(good, root)
    dist.barrier()
    return root, good, reference


@functools.cache
def _lenient_with_extra_layer() -> tuple[object, str | None]:
    """Non-strict: a model with an extra layer validated from `good.ckpt`; its Trainer and warning."""
    _, good, _ = _bad_input_files()
    return _lenient_warning(good, extra_layer=True)


def strict_loading_false_extra_layer_case() -> dict:
    """A model with an extra layer loads the matching keys and reports the rest."""
    _, _, reference = _bad_input_files()
    lenient, warning = _lenient_with_extra_layer()
    lenient_params = full_params(lenient)
    if dist.get_rank() != 0:  # full params are gathered onto rank 0 only
        return None
    return {
        "lenient_max_diff": max((lenient_params[k] - reference[k]).abs().max().item() for k in reference),
        "lenient_extra_is_fresh": torch.equal(lenient_params["extra.weight"], Lenient(extra_layer=True).extra.weight),
        "lenient_warning": warning,
    }


def strict_loading_false_unexpected_keys_case() -> str | None:
    """A checkpoint with keys the model lacks loads the rest, reporting them as unexpected."""
    root, _, _ = _bad_input_files()
    lenient, _ = _lenient_with_extra_layer()
    lenient.save_checkpoint(root / "with_extra.ckpt")
    return _lenient_warning(root / "with_extra.ckpt")[1]


def strict_loading_false_full_file_case() -> str | None:
    """The same from a full-format file."""
    root, good, _ = _bad_input_files()
    converter = trainer_for(FullyShardStrategy(checkpoint_format="full"))
    converter.validate(ResumeModule(), val_loader(), ckpt_path=str(good), verbose=False)
    converter.save_checkpoint(root / "good_full.ckpt")
    return _lenient_warning(root / "good_full.ckpt", extra_layer=True)[1]


#: Bad input, by case: (checkpoint path under the bad-input directory, keyword arguments of the module).
BAD_INPUTS = {
    "strict_extra": ("good.ckpt", {"extra_layer": True}),
    "incompatible": ("good.ckpt", {"hidden": 8}),
    "missing": ("missing.ckpt", {}),
    "not_a_checkpoint": ("not_a_checkpoint", {}),
    "not_a_checkpoint_file": ("not_a_checkpoint/notes.txt", {}),
    "truncated": ("truncated.ckpt", {}),
    "corrupted": ("corrupted.ckpt", {}),
    "newer_sharded": ("newer_sharded.ckpt", {}),
    "newer_full": ("newer_full.ckpt", {}),
}


def bad_input_case(name: str) -> list[str | None]:
    """The error every rank got validating from the bad input `name`, in rank order."""
    root, _, _ = _bad_input_files()
    path, kwargs = BAD_INPUTS[name]
    return gather(error_of(lambda: _validate(root / path, **kwargs)))


def group_bad_input() -> Iterator[Case]:
    yield Case("strict_loading_false_extra_layer", strict_loading_false_extra_layer_case)
    yield Case("strict_loading_false_unexpected_keys", strict_loading_false_unexpected_keys_case)
    yield Case("strict_loading_false_full_file", strict_loading_false_full_file_case)
    for name in BAD_INPUTS:
        yield Case(f"bad_input_{name}", lambda name=name: bad_input_case(name))


# ---------------------------------------------------------------------- kill during save
class KillDuringThirdSave(Callback):
    """SIGKILLs rank 0 in the middle of the third save: after every rank wrote its shards, before `meta.pt`."""

    def setup(self, trainer, pl_module, stage):
        original = checkpoint_writer._finish
        count = {"saves": 0}

        def finish(*args, **kwargs):
            count["saves"] += 1
            if count["saves"] == 3 and dist.get_rank() == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)

        checkpoint_writer._finish = finish


def kill_case() -> None:
    """Saves every step into `case_dir("kill")` until rank 0 is killed in its third save; never returns normally."""
    callback = ModelCheckpoint(
        dirpath=case_dir("kill"), filename="{step}", every_n_train_steps=1, save_top_k=-1, save_last=True
    )
    trainer = trainer_for(
        FullyShardStrategy(), max_steps=10, callbacks=[callback, KillDuringThirdSave()], enable_checkpointing=True
    )
    trainer.fit(ResumeModule(), train_loader())


def after_kill_resume_case() -> dict:
    """In a fresh launch: the checkpoints saved before the kill load, by path and through "last"."""
    root = saved_by("kill")
    names = sorted(os.listdir(root))
    loaded = {}
    for name in ("step=1.ckpt", "last.ckpt"):
        module = ResumeModule()
        trainer = trainer_for(FullyShardStrategy(), max_steps=3)
        trainer.callbacks.append(ModelCheckpoint(dirpath=root, save_top_k=0, save_last=False))  # for "last"
        trainer.fit(module, train_loader(), ckpt_path="last" if name == "last.ckpt" else str(root / name))
        loaded[name] = min(step for step, _ in module.losses) if module.losses else None
    return {"names": names, "first_step": loaded}


def after_kill_partial_case() -> dict:
    """In a fresh launch: the partial checkpoint the kill left is hidden, and refused when named."""
    root = saved_by("kill")
    partial = [n for n in sorted(os.listdir(root)) if n.startswith(".dpar-partial-")]
    refused = error_of(
        lambda: trainer_for(FullyShardStrategy()).validate(
            ResumeModule(), val_loader(), ckpt_path=str(root / partial[0]) if partial else "none", verbose=False
        )
    )
    return {
        "partial": partial,
        "partial_content": sorted(os.listdir(root / partial[0])) if partial else [],
        "refused": refused,
    }


GROUPS = {
    "ckpt_resume": group_resume,
    "ckpt_resume_last": one_case("resume_last", resume_last_case),
    "ckpt_bad_input": group_bad_input,
    "ckpt_kill": one_case("kill", kill_case),
    "ckpt_after_kill": lambda: [
        Case("after_kill_partial", after_kill_partial_case),
        Case("after_kill_resume", after_kill_resume_case),
    ],
}
