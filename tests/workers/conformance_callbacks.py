"""Cases for `tests/test_conformance_callbacks.py`: Lightning's built-in callbacks under each strategy column,
compared with Lightning's own DDP on the same global batches in the same launch.

One group per column (`cb_dpar_replicate`, `cb_dpar_fsdp`, `cb_dpar_hsdp`, `cb_dpar_2d`, `cb_pipeline`); each callback
is a case of that group. DDP runs on every rank of the launch with `BATCH * dp / world` samples per rank, so its
global batches are exactly the strategy's (Lightning's sampler shuffles one permutation, whatever the number of
replicas, and each step takes the next `BATCH * dp` indices of it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import (
    EMAWeightAveraging,
)
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, ReplicateStrategy
from tests.models import Net, RegressionData, loader
from tests.workers.cases import Case
from tests.workers.common import BATCH, trainer_for, world_size

#: Tensor parallelism inside the backbone's blocks (the head stays replicated).
TP_PLAN = {"backbone.layers.*.fc1": "colwise", "backbone.layers.*.fc2": "rowwise"}
#: Batches per epoch (epoch-based callbacks: SWA, BackboneFinetuning, GradientAccumulationScheduler).
EPOCH_BATCHES = 2


class BackboneModule(L.LightningModule):
    """A backbone (`Net`: a linear, two residual blocks, a linear) and a head; the optimizer takes the trainable
    parameters only, as Lightning's finetuning docs ask."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = Net(depth=2)
        self.head = nn.Linear(5, 5)
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.backbone(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr, momentum=0.9)


# ---------------------------------------------------------------------------------------------------- columns
COLUMNS: dict[str, tuple[int, Callable[[], Any]]] = {
    # column: (data-parallel size as a function of the world, strategy factory)
    "dpar_replicate": (1, lambda: ReplicateStrategy()),
    "dpar_fsdp": (1, lambda: FullyShardStrategy()),
    "dpar_hsdp": (1, lambda: FullyShardStrategy(replicate_size=2)),
    "dpar_2d": (2, lambda: FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=TP_PLAN)),
    "pipeline": (2, lambda: FullyShardStrategy(pipeline_parallel_size=2)),
}


def data_parallel(column: str) -> int:
    return world_size() // COLUMNS[column][0]


def fit(
    strategy: Any, callbacks: list, batch: int, val_loader: Any = None, **kwargs: Any
) -> tuple[L.Trainer, BackboneModule]:
    module = BackboneModule()
    defaults: dict[str, Any] = dict(max_steps=4, callbacks=callbacks)
    defaults.update(kwargs)
    trainer = trainer_for(strategy, **defaults)
    trainer.fit(module, loader(RegressionData(), batch), val_loader)
    return trainer, module


def gathered(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors of a state dict of DTensors (each pipeline stage's part, merged on every rank); collective."""
    local = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone() for k, v in state.items()}
    parts: list[Any] = [None] * world_size()
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want), (sorted(got), sorted(want))
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return gathered({k: v for k, v in module.state_dict().items()})


def compare(
    column: str,
    make_callbacks: Callable[[], list],
    read: Callable[[L.Trainer, BackboneModule, list], dict],
    **fit_kwargs: Any,
) -> dict:
    """Fit under the column's strategy and under Lightning's DDP with fresh callbacks; `read` returns named whole
    state dicts; the result is, per name, the largest difference."""
    dp = data_parallel(column)
    callbacks = make_callbacks()
    trainer, module = fit(COLUMNS[column][1](), callbacks, BATCH, **fit_kwargs)
    ours = read(trainer, module, callbacks)
    ddp_callbacks = make_callbacks()
    ddp_trainer, ddp_module = fit("ddp", ddp_callbacks, BATCH * dp // world_size(), **fit_kwargs)
    theirs = read(ddp_trainer, ddp_module, ddp_callbacks)
    return {name: max_diff(ours[name], theirs[name]) for name in theirs}


# ---------------------------------------------------------------------------------------------------- cases
def averaged_state(callback: Any) -> dict[str, torch.Tensor]:
    """The averaged weights a weight-averaging callback holds, keyed like the LightningModule's state dict."""
    average = callback._average_model
    if isinstance(average, torch.optim.swa_utils.AveragedModel):
        return {k[len("module.") :]: v for k, v in average.state_dict().items() if k.startswith("module.")}
    return dict(average.state_dict())


def ema_case(column: str) -> dict:
    def read(trainer, module, callbacks):
        return {"model": weights(module), "average": gathered(averaged_state(callbacks[0]))}

    # Validation every 2 steps swaps the averaged weights in and out (Lightning's `_swap_models`).
    val = loader(RegressionData(n=16, seed=5), BATCH)
    return compare(column, lambda: [EMAWeightAveraging(decay=0.7)], read, val_check_interval=2, val_loader=val)


CASES: dict[str, Callable[[str], Any]] = {"ema": ema_case}


def column_group(column: str) -> Callable[[], Iterator[Case]]:
    def group() -> Iterator[Case]:
        for name, case in CASES.items():
            yield Case(f"cb_{column}_{name}", functools.partial(case, column))

    return group


GROUPS = {f"cb_{column}": column_group(column) for column in COLUMNS}
