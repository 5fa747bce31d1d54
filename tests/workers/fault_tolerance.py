"""Workers of `tests/launched/test_fault_tolerance.py`, run directly by torchrun (one launch per replica group):

    REPLICA_GROUP_ID=g NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=... torchrun --nproc-per-node 2 fault_tolerance.py ft OUT
    torchrun --nproc-per-node 4 fault_tolerance.py hsdp OUT            # the plain HSDP 2 x 2 run, for parity

Every rank writes `OUT/<mode>_g<group>_r<rank>_<pid>.pt`: the full parameters after training (gathered within the
group), the steps it took (`StepRecord`s), its heals, and its Lightning batch indices. `DPAR_FT_*` variables shape
the run: steps, optimizer, data size, a NaN put into one group's gradients at one step (`DPAR_FT_NAN_AT`,
`DPAR_FT_NAN_GROUP`, with `on_nonfinite="skip"`), the batch at which group `DPAR_FT_MARK_GROUP` writes `OUT/mark`
(the test kills that group when it appears), and the pause per step while fewer groups than all are in the quorum
(so that survivors take a measurable number of steps while a group is down).

Two test hooks make a heal cut short deterministic (`HookedStrategy`): on a live group, `DPAR_FT_HEAL_PAUSE_RANK=r`
makes group rank `r` write `OUT/heal_paused` and sleep instead of handing torchft its state when a relaunched group
heals from it (its other ranks serve theirs), so the test can kill the source in the middle of the transfer; on any
group, each heal this rank applied writes `OUT/healed_g<group>_r<rank>_<pid>`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

if __name__ == "__main__":  # run by torchrun: the repository, not this directory, on the path
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_dpar import FaultTolerance, FaultTolerantFullyShardStrategy, FullyShardStrategy
from tests.support.fault_tolerance import SCHEDULE
from tests.support.models import ParityModule, RegressionData, loader
from tests.workers import common
from tests.workers.common import full_params, trainer_for

BATCH = 4


class ScheduledModule(ParityModule):
    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, **SCHEDULE)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class HookedStrategy(FaultTolerantFullyShardStrategy):
    """The strategy with the test hooks of the module docstring (nothing changes without the variables)."""

    def _healing_payload(self):
        pause_rank = os.environ.get("DPAR_FT_HEAL_PAUSE_RANK")
        if pause_rank is not None and self.global_rank == int(pause_rank) and self._heal_position is not None:
            (Path(sys.argv[2]) / "heal_paused").write_text(str(time.time()))
            time.sleep(3600)  # the test kills this group now
        return super()._healing_payload()

    def _heal(self, payload):
        super()._heal(payload)
        group = self.fault_tolerance.replica_group
        (Path(sys.argv[2]) / f"healed_g{group}_r{self.global_rank}_{os.getpid()}").write_text(str(time.time()))


class PoisonedModule(ParityModule):
    """NaN in the first gradient element of group rank 1 of group `DPAR_FT_NAN_GROUP` at global step
    `DPAR_FT_NAN_AT`, after the group reduced its gradients and before the average across groups."""

    def on_after_backward(self):
        group = self.trainer.strategy.fault_tolerance.replica_group
        if group == _env_int("DPAR_FT_NAN_GROUP", -1) and self.global_step == _env_int("DPAR_FT_NAN_AT", -1):
            if self.trainer.global_rank == 1:
                grad = self.model.out.bias.grad
                (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("nan")


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


class Pace(L.Callback):
    """Marks the kill point and slows the survivors while a group is missing."""

    def __init__(self, out: Path, mark_at: int = -1, mark_group: int = -1, pause: float = 0.0, kill: bool = False):
        self.out = out
        self.mark_at, self.mark_group, self.pause = mark_at, mark_group, pause
        self.kill = kill  # the marking rank SIGKILLs itself (under Ray, which then restarts its group)
        self.batches: list[int] = []
        self.times: list[float] = []
        self._logged_saves = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append(batch_idx)
        self.times.append(time.time())
        strategy = trainer.strategy
        groups = getattr(strategy, "replica_groups", None)
        config = getattr(strategy, "fault_tolerance", None)
        if groups is None:  # the plain HSDP run: marks the kill point of the restart-from-checkpoint baseline
            if batch_idx == self.mark_at and trainer.global_rank == 0 and not (self.out / "mark").exists():
                (self.out / "mark").write_text(str(time.time()))
            return
        # One draw from the torch RNG per batch on every rank: a healed rank continues the peer's stream, so the
        # groups draw the same numbers at the same batches (the test compares them).
        draw = int(torch.randint(0, 2**31, (1,)).item())
        if trainer.global_rank == 0 and groups.history:  # flushed per step: a killed launch's steps stay logged
            with open(self.out / f"steps_g{config.replica_group}_{os.getpid()}.jsonl", "a") as log:
                entry = {"group": config.replica_group, "draw": draw, **asdict(groups.history[-1])}
                log.write(json.dumps(entry) + "\n")
        self.log_saves(trainer)
        if batch_idx == self.mark_at and config.replica_group == self.mark_group and trainer.global_rank == 0:
            if not (self.out / "mark").exists():  # once: not again in the relaunched group
                (self.out / "mark").write_text(str(time.time()))
                if self.kill:
                    os.kill(os.getpid(), signal.SIGKILL)
                while True:  # the test SIGKILLs the group now: its last step is the marked one on any machine
                    time.sleep(60)
        if self.pause and groups.history and groups.history[-1].participants < config.num_replica_groups:
            time.sleep(self.pause)

    def log_saves(self, trainer) -> None:
        """The checkpoints this group wrote (the strategy's own list of the saves it did not skip)."""
        groups, config = trainer.strategy.replica_groups, trainer.strategy.fault_tolerance
        if trainer.global_rank != 0:
            return
        with open(self.out / f"saves_g{config.replica_group}_{os.getpid()}.jsonl", "a") as log:
            for step in groups.saved[self._logged_saves :]:
                log.write(json.dumps({"group": config.replica_group, "step": step}) + "\n")
        self._logged_saves = len(groups.saved)

    def on_train_end(self, trainer, pl_module):
        if getattr(trainer.strategy, "replica_groups", None) is not None:
            self.log_saves(trainer)


def main(mode: str, out: Path) -> None:
    steps = _env_int("DPAR_FT_STEPS", 6)
    optimizer = os.environ.get("DPAR_FT_OPTIMIZER", "adam")
    data = RegressionData(n=_env_int("DPAR_FT_SAMPLES", 128))
    (out / f"pid_{os.environ.get('REPLICA_GROUP_ID', 'x')}_{os.getpid()}").write_text("")
    if mode == "hsdp":
        strategy = FullyShardStrategy(replicate_size=2)
        group = -1
    else:
        config = FaultTolerance(
            timeout=float(os.environ.get("DPAR_FT_TIMEOUT", "30")),
            start_timeout=float(os.environ.get("DPAR_FT_START_TIMEOUT", "120")),
        )
        context: dict = {"context_parallel_size": 2} if mode == "ft_cp" else {}
        if "DPAR_FT_NAN_AT" in os.environ:
            context["on_nonfinite"] = "skip"
        strategy = HookedStrategy(fault_tolerance=config, **context)
        group = int(os.environ["REPLICA_GROUP_ID"])
    pace = Pace(
        out,
        _env_int("DPAR_FT_MARK_AT", -1),
        _env_int("DPAR_FT_MARK_GROUP", -1),
        float(os.environ.get("DPAR_FT_PAUSE", "0")),
    )
    callbacks: list[L.Callback] = [pace]
    every = _env_int("DPAR_FT_CKPT_EVERY", 0)
    if every:
        callbacks.append(ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=every, save_top_k=-1))
    trainer = trainer_for(strategy, max_steps=steps, callbacks=callbacks, enable_checkpointing=bool(every))
    resume = os.environ.get("DPAR_FT_RESUME")
    if mode == "ft_cp":  # each sequence split over the group's two ranks: the example GPT on token ids
        from tests.workers.context_parallel import GPTModule, gpt_data

        trainer.fit(GPTModule(), DataLoader(gpt_data(), batch_size=common.BATCH))
    else:
        module_class = ScheduledModule if os.environ.get("DPAR_FT_SCHEDULER") == "1" else ParityModule
        module_class = PoisonedModule if "DPAR_FT_NAN_AT" in os.environ else module_class
        trainer.fit(module_class(optimizer=optimizer), loader(data, BATCH), ckpt_path=resume)
    _save(trainer, pace, out, mode, group)


def _save(trainer: L.Trainer, pace: Pace, out: Path, mode: str, group: int) -> None:
    params = full_params(trainer)
    groups = getattr(trainer.strategy, "replica_groups", None)
    record = {
        "params": params if trainer.global_rank == 0 else None,
        "history": [asdict(r) for r in groups.history] if groups is not None else [],
        "heals": [asdict(h) for h in groups.heals] if groups is not None else [],
        "batches": pace.batches,
        "context_parallel_bytes": _key_value_bytes(trainer),
        "batch_times": pace.times,
        "end": time.time(),
    }
    torch.save(record, out / f"{mode}_g{group}_r{trainer.global_rank}_{os.getpid()}.pt")


def _key_value_bytes(trainer: L.Trainer) -> int:
    """Keys and values this rank sent in its forwards under context parallelism (0 without it)."""
    applied = getattr(trainer.strategy, "applied", None)
    runtime = applied.context_parallel if applied is not None else None
    return runtime.attention.counter.forward_bytes if runtime is not None else 0


def ray_job(config: dict) -> None:
    """A Ray Train worker of `TorchTrainer(torch_config=TorchftConfig(...))`: one replica group of one rank. The
    worker of group `config["kill_group"]` SIGKILLs itself after batch `config["kill_at"]`, once; Ray restarts that
    group only."""
    from ray.train.lightning import RayLightningEnvironment

    from lightning_dpar.ray import prepare_trainer

    out = Path(config["out"])
    strategy = FaultTolerantFullyShardStrategy(fault_tolerance=FaultTolerance(timeout=20.0))
    pace = Pace(out, config["kill_at"], config["kill_group"], config["pause"], kill=True)
    trainer = L.Trainer(
        accelerator="cpu", strategy=strategy, plugins=[RayLightningEnvironment()], max_steps=config["steps"],
        callbacks=[pace], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer = prepare_trainer(trainer)
    (out / f"pid_{strategy.fault_tolerance.replica_group}_{os.getpid()}").write_text("")
    data = RegressionData(n=config["samples"])
    trainer.fit(ParityModule(optimizer=config["optimizer"]), loader(data, BATCH))
    _save(trainer, pace, out, "ray", strategy.fault_tolerance.replica_group)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
