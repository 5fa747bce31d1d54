"""Optimizers whose update is not elementwise, through real Trainers (`tests/launched/test_optimizers.py`): each trains
exactly as under Lightning's DDP on the same global batches, or is refused on every rank before the first step."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, ReplicateStrategy
from tests.support.models import IN_DIM, RegressionData, global_batches, loader
from tests.workers.cases import Case
from tests.workers.checkpoint_common import case_dir
from tests.workers.common import BATCH, STEPS, full_params, trainer_for, world_size

#: Column- then row-wise, as a user would shard the MLP's two matrices.
MLP_TP_PLAN = {"model.fc1": "colwise", "model.fc2": "rowwise"}


class MLP(nn.Module):
    """Two matrices and no biases (Muon takes 2D parameters only); 12 rows and 5 rows shard unevenly."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN_DIM, 12, bias=False)
        self.fc2 = nn.Linear(12, 5, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


class LARSLike(torch.optim.Optimizer):
    """A user's layer-wise adaptive optimizer, unknown to the package: SGD scaled by ||w|| / ||g|| per tensor."""

    def __init__(self, params, lr: float = 0.1, trust: float = 0.02) -> None:
        super().__init__(params, {"lr": lr, "trust": trust})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    ratio = group["trust"] * p.norm() / (p.grad.norm() + 1e-9)
                    p.sub_(group["lr"] * ratio * p.grad)
        return loss


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "muon": lambda params: torch.optim.Muon(params, lr=0.02),
    "adafactor": lambda params: torch.optim.Adafactor(params, lr=0.01),
    "lars": lambda params: LARSLike(params),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01),
}


class MLPModule(L.LightningModule):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        torch.manual_seed(0)
        self.model = MLP()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        return OPTIMIZERS[self.optimizer_name](self.parameters())


def fit(strategy: Any, optimizer: str) -> dict[str, torch.Tensor] | None:
    """Train 3 steps; the full parameters on rank 0 (None elsewhere)."""
    trainer = trainer_for(strategy)
    trainer.fit(MLPModule(optimizer), loader(RegressionData(), BATCH))
    got = full_params(trainer)
    return {k: v.clone() for k, v in got.items()} if trainer.global_rank == 0 else None


@functools.cache
def ddp_reference(optimizer: str) -> dict[str, torch.Tensor] | None:
    """Lightning's own DDP on the same ranks and global batches: the ground truth."""
    return fit("ddp", optimizer)


def one_process_reference(optimizer: str, dp: int) -> dict[str, torch.Tensor]:
    """Training in this process on the global batches of `dp` data-parallel ranks (for layouts whose data-parallel
    size is not the world's, which Lightning's DDP cannot match)."""
    module = MLPModule(optimizer)
    opt = module.configure_optimizers()
    for x, y in global_batches(RegressionData(), dp, BATCH, STEPS):
        opt.zero_grad()
        F.mse_loss(module.model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def parity_with_ddp(strategy: Callable[[], Any], optimizer: str, dp: int | None = None) -> dict[str, float] | None:
    """The largest difference to DDP (or, with `dp`, to one process) on the same global batches."""
    want = ddp_reference(optimizer) if dp is None else one_process_reference(optimizer, dp)
    got = fit(strategy(), optimizer)
    if got is None or want is None:
        return None
    start = MLPModule(optimizer).state_dict()
    return {
        "max_abs_diff": max((got[k] - want[k]).abs().max().item() for k in want),
        "moved": max((want[k] - start[k]).abs().max().item() for k in want),
    }


def resumes_exactly(strategy: Callable[[], Any], optimizer: str) -> dict[str, float] | None:
    """3 steps saving at step 2, then a new Trainer resuming there for the 3rd: the same parameters, bit for bit?"""
    root = case_dir(f"resume_{optimizer}")
    every = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    continuous = trainer_for(strategy(), enable_checkpointing=True, callbacks=[every])
    continuous.fit(MLPModule(optimizer), loader(RegressionData(), BATCH))
    want = full_params(continuous)
    resumed = trainer_for(strategy())
    resumed.fit(MLPModule(optimizer), loader(RegressionData(), BATCH), ckpt_path=str(root / "step=2.ckpt"))
    got = full_params(resumed)
    if resumed.global_rank != 0:
        return None
    return {"max_abs_diff": max((want[k] - got[k]).abs().max().item() for k in want)}


def refused(strategy: Callable[[], Any], optimizer: str) -> dict[str, Any]:
    """The error each rank raised (every rank must raise), and whether any step ran first."""
    trainer = trainer_for(strategy())
    module = MLPModule(optimizer)
    try:
        trainer.fit(module, loader(RegressionData(), BATCH))
    except Exception as error:  # the case records each rank's message; a rank that does not raise fails it
        return {"type": type(error).__name__, "message": str(error), "global_step": trainer.global_step}
    raise AssertionError(f"{optimizer} trained under {trainer.strategy} instead of being refused")


def gathered(value: dict[str, Any]) -> list[dict[str, Any]]:
    """`value` from every rank, on rank 0 (the launch's process group is up once a Trainer ran)."""
    import torch.distributed as dist

    values: list[Any] = [None] * world_size()
    dist.all_gather_object(values, value)
    return values


def fsdp() -> str:
    return "dpar_fsdp"


def tensor_parallel() -> FSDPTensorParallelStrategy:
    return FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=MLP_TP_PLAN)


def replicate() -> ReplicateStrategy:
    return ReplicateStrategy()


def group_optimizers() -> Iterator[Case]:
    yield Case("replicate_adafactor", lambda: parity_with_ddp(replicate, "adafactor"))
    yield Case("replicate_lars", lambda: parity_with_ddp(replicate, "lars"))
    yield Case("fsdp_adamw", lambda: parity_with_ddp(fsdp, "adamw"))
    yield Case("fsdp_muon", lambda: parity_with_ddp(fsdp, "muon"))
    yield Case("tp_muon", lambda: parity_with_ddp(tensor_parallel, "muon", dp=world_size() // 2))
    yield Case("tp_adamw", lambda: parity_with_ddp(tensor_parallel, "adamw", dp=world_size() // 2))
    yield Case("tp_muon_resume", lambda: resumes_exactly(tensor_parallel, "muon"))
    yield Case("fsdp_adafactor", lambda: gathered(refused(fsdp, "adafactor")))
    yield Case("tp_adafactor", lambda: gathered(refused(tensor_parallel, "adafactor")))
    yield Case("fsdp_lars", lambda: gathered(refused(fsdp, "lars")))


def hsdp() -> FullyShardStrategy:
    return FullyShardStrategy(replicate_size=2)


def group_optimizers4() -> Iterator[Case]:
    """Meshes of two dims of size 2: the update travels along both (`distributed_muon._broadcast_from`)."""
    yield Case("hsdp_muon", lambda: parity_with_ddp(hsdp, "muon"))
    yield Case("2d_muon", lambda: parity_with_ddp(tensor_parallel, "muon", dp=world_size() // 2))


GROUPS = {"optimizers": group_optimizers, "optimizers4": group_optimizers4}
