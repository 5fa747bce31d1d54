"""Training functions run by Ray Train workers (`TorchTrainer(train_loop_per_worker=...)`) for
`tests/launched/test_ray_train.py`, and its torchrun case: resuming outside Ray from a checkpoint Ray kept.

Ray workers import this module by name (the test puts the repository on their `PYTHONPATH`); each function writes
what the test reads into `config["out"]` on rank 0. `ray` is imported inside the functions: the torchrun launcher
imports this module where `ray` may be missing.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy
from tests.support.models import TP_PLAN, ParityModule, RegressionData, loader
from tests.workers.cases import one_case
from tests.workers.checkpoint_common import case_dir, saved_by
from tests.workers.common import BATCH, full_params, trainer_for

#: The layouts every strategy runs in under Ray: (Trainer strategy, data-parallel size) by name and world size.
STRATEGIES: dict[str, Any] = {
    "dpar_replicate": lambda: "dpar_replicate",
    "dpar_fsdp": lambda: FullyShardStrategy(async_save=True),  # reported only once written in the background
    "dpar_hsdp": lambda: FullyShardStrategy(replicate_size=2),
    "dpar_2d": lambda: FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=TP_PLAN),
    "dpar_3d": lambda: FSDPTensorParallelStrategy(tensor_parallel_size=2, pipeline_parallel_size=2, tp_plan=TP_PLAN),
}
#: Every how many steps the tests report a checkpoint to Ray.
REPORT_EVERY = 2


def ray_trainer(
    strategy: Any, max_steps: int, callbacks: list[L.Callback], prepare: bool = True, accelerator: str = "cpu"
) -> L.Trainer:
    """Ray's recipe with the one change: `lightning_dpar.ray.prepare_trainer`."""
    from ray.train.lightning import RayLightningEnvironment

    from lightning_dpar.ray import prepare_trainer

    trainer = L.Trainer(
        accelerator=accelerator,
        strategy=strategy,
        plugins=[RayLightningEnvironment()],
        max_steps=max_steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return prepare_trainer(trainer) if prepare else trainer


def _error_of(fn: Any) -> str | None:
    try:
        fn()
    except Exception as error:  # the message is what the test checks
        return f"{type(error).__name__}: {error}"
    return None


def _write(out: str, name: str, value: Any) -> None:
    if dist.get_rank() == 0:
        (Path(out) / name).write_text(json.dumps(value))


def strategies_job(config: dict[str, Any]) -> None:
    """Each named strategy trains `steps` steps on the worker group, reporting a checkpoint every `REPORT_EVERY`;
    rank 0 saves the full parameters, the data-parallel size and the process group's backend. With
    `recipe_errors`, first what Ray's recipe without the change gives: Ray's `prepare_trainer`, and none at all."""
    import ray.train.lightning

    from lightning_dpar.ray import RayTrainReportCallback, prepare_trainer

    out, steps, accelerator = config["out"], config["steps"], config.get("accelerator", "cpu")
    if config.get("recipe_errors"):
        unprepared = ray_trainer(FullyShardStrategy(), steps, [], prepare=False)
        with_rays_callback = ray_trainer(
            FullyShardStrategy(), steps, [ray.train.lightning.RayTrainReportCallback()], False
        )
        errors = {
            "ray_prepare_trainer": _error_of(lambda: ray.train.lightning.prepare_trainer(unprepared)),
            "no_prepare_trainer": _error_of(lambda: unprepared.fit(ParityModule(), loader(RegressionData(), BATCH))),
            "rays_callback": _error_of(lambda: prepare_trainer(with_rays_callback)),
        }
        if ray.train.get_context().get_world_rank() == 0:  # both failed on every worker before any collective
            (Path(out) / "recipe_errors.json").write_text(json.dumps(errors))
    for name in config["strategies"]:
        report = RayTrainReportCallback(
            every_n_train_steps=REPORT_EVERY, dirname=f"{name}-epoch={{epoch}}-step={{step}}"
        )
        trainer = ray_trainer(STRATEGIES[name](), steps, [report], accelerator=accelerator)
        trainer.fit(ParityModule(), loader(RegressionData(), BATCH))
        params = full_params(trainer)
        if trainer.global_rank == 0:
            assert trainer.strategy.dims is not None
            saved = {"params": params, "dp": trainer.strategy.dims.data_parallel, "backend": dist.get_backend()}
            torch.save(saved, Path(out) / f"{name}.pt")


class _KillPoint(L.Callback):
    """On the first attempt only, at the start of step `at`, rank 1 says its pid (a file) and waits to be killed."""

    def __init__(self, out: str, at: int) -> None:
        self.out, self.at = Path(out), at

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at and trainer.global_rank == 1 and not (self.out / "killed_at").exists():
            (self.out / "pid").write_text(str(os.getpid()))
            time.sleep(300)  # the test kills this process with SIGKILL


class _ResumeProbe(L.Callback):
    """Rank 0 records where this attempt's training starts, and when the training function started and its first
    step ended (epoch time)."""

    def __init__(self, out: str, resumed_from: str | None, started: float) -> None:
        self.out, self.resumed_from, self.started = Path(out), resumed_from, started
        self.first: dict[str, Any] | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.first is None:
            self.first = {"resumed_from": self.resumed_from, "global_step": trainer.global_step, "batch_idx": batch_idx}
            self.first["function_start"] = self.started

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.first is not None and "first_step_end" not in self.first and trainer.global_rank == 0:
            self.first["first_step_end"] = time.time()
            attempt = len(list(self.out.glob("attempt-*.json")))
            (self.out / f"attempt-{attempt}.json").write_text(json.dumps(self.first))


def kill_job(config: dict[str, Any]) -> None:
    """`dpar_fsdp` for `steps` steps, reporting every `REPORT_EVERY`; rank 1 is killed at step `kill_at` of the
    first attempt; each attempt resumes from the latest checkpoint Ray kept."""
    from lightning_dpar.ray import RayTrainReportCallback, latest_checkpoint

    started = time.time()  # this worker process is up, torch and Lightning imported, Ray's process group made
    out = config["out"]
    resume = latest_checkpoint()
    callbacks = [
        RayTrainReportCallback(every_n_train_steps=REPORT_EVERY),
        _KillPoint(out, config["kill_at"]),
        _ResumeProbe(out, resume, started),
    ]
    trainer = ray_trainer("dpar_fsdp", config["steps"], callbacks)
    trainer.fit(ParityModule(), loader(RegressionData(), BATCH), ckpt_path=resume)
    params = full_params(trainer)
    if trainer.global_rank == 0:
        torch.save({"params": params}, Path(out) / "kill.pt")


# ---------------------------------------------------------------------- torchrun: resume from Ray's checkpoint
def resume_outside_ray_case() -> dict[str, Any] | None:
    """`fit(ckpt_path=<the checkpoint Ray kept at step 2>)` under torchrun, same layout, to step 4, then a save of
    its own there: the sharded checkpoint that Ray's step-4 one is compared with."""
    checkpoint = saved_by("ray_fsdp_step2")
    trainer = trainer_for("dpar_fsdp", max_steps=4)
    probe = _FirstBatch()
    trainer.callbacks.append(probe)
    trainer.fit(ParityModule(), loader(RegressionData(), BATCH), ckpt_path=str(checkpoint))
    params = full_params(trainer)
    saved = case_dir("ray_resume_outside") / "step4"
    trainer.save_checkpoint(saved)
    if trainer.global_rank != 0:
        return None
    return {"first": probe.first, "params": {k: v.tolist() for k, v in params.items()}, "saved": str(saved)}


class _FirstBatch(L.Callback):
    def __init__(self) -> None:
        self.first: dict[str, int] | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.first is None:
            self.first = {"global_step": trainer.global_step, "batch_idx": batch_idx}


GROUPS = {"ray_resume": one_case("ray_resume_outside", resume_outside_ray_case)}
