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
    BackboneFinetuning,
    EarlyStopping,
    EMAWeightAveraging,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelPruning,
    StochasticWeightAveraging,
)
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, ReplicateStrategy
from tests.models import Net, RegressionData, loader
from tests.workers.cases import Case
from tests.workers.checkpoint_common import case_dir
from tests.workers.common import BATCH, trainer_for, world_size

#: Tensor parallelism inside the backbone's blocks (the head stays replicated).
TP_PLAN = {"backbone.layers.*.fc1": "colwise", "backbone.layers.*.fc2": "rowwise"}
#: Batches per epoch (epoch-based callbacks: SWA, BackboneFinetuning, GradientAccumulationScheduler).
EPOCH_BATCHES = 2


class BackboneModule(L.LightningModule):
    """A backbone (`Net`: a linear, two residual blocks, a linear) and a head; the optimizer takes the trainable
    parameters only, as Lightning's finetuning docs ask."""

    def __init__(self, lr: float = 0.05, step_lr: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = Net(depth=2)
        self.head = nn.Linear(5, 5)
        self.lr, self.step_lr = lr, step_lr

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
        optimizer = torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr, momentum=0.9)
        if not self.step_lr:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


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
    strategy: Any,
    callbacks: list,
    batch: int,
    val_loader: Any = None,
    ckpt_path: str | None = None,
    module_kwargs: dict | None = None,
    **kwargs: Any,
) -> tuple[L.Trainer, BackboneModule]:
    module = BackboneModule(**(module_kwargs or {}))
    defaults: dict[str, Any] = dict(max_steps=4, callbacks=callbacks)
    defaults.update(kwargs)
    trainer = trainer_for(strategy, **defaults)
    trainer.fit(module, loader(RegressionData(), batch), val_loader, ckpt_path=ckpt_path)
    return trainer, module


def gathered(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors of a state dict of DTensors (each pipeline stage's part, merged on every rank); collective."""
    local = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone() for k, v in state.items()}
    parts: list[Any] = [None] * world_size()
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


def max_diff(got: Any, want: Any) -> float:
    """The largest difference between two state dicts, or two lists of numbers (of the same length)."""
    if not isinstance(want, dict):
        assert len(got) == len(want), (got, want)
        return max((abs(a - b) for a, b in zip(got, want)), default=0.0)
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
    state dicts (or lists of numbers); the result is, per name, the largest difference."""
    callbacks = make_callbacks()
    trainer, module = fit(COLUMNS[column][1](), callbacks, BATCH, **fit_kwargs)
    ours = read(trainer, module, callbacks)
    ddp_callbacks = make_callbacks()
    ddp_trainer, ddp_module = fit("ddp", ddp_callbacks, ddp_batch(column), **fit_kwargs)
    theirs = read(ddp_trainer, ddp_module, ddp_callbacks)
    return {name: max_diff(ours[name], theirs[name]) for name in theirs}


def ddp_batch(column: str) -> int:
    """DDP's batch per rank for the column's global batch (DDP's data-parallel size is the whole world)."""
    return BATCH * data_parallel(column) // world_size()


# ---------------------------------------------------------------------------------------------------- cases
def averaged_state(callback: Any) -> dict[str, torch.Tensor]:
    """The averaged weights a weight-averaging callback holds, keyed like the LightningModule's state dict."""
    average = callback._average_model
    if isinstance(average, torch.optim.swa_utils.AveragedModel):
        return {k[len("module.") :]: v for k, v in average.state_dict().items() if k.startswith("module.")}
    return dict(average.state_dict())


def laid_out_like_model(callback: Any, module: nn.Module) -> bool:
    """Every averaged tensor has its parameter's type, and a DTensor's mesh and placements."""
    params = dict(module.named_parameters())
    averaged = averaged_state(callback)
    return all(
        type(averaged[name]) is type(p.data)
        and (
            not isinstance(p, DTensor)
            or (averaged[name].placements, averaged[name].device_mesh)
            == (
                p.placements,
                p.device_mesh,
            )
        )
        for name, p in params.items()
    )


def ema_case(column: str) -> dict:
    layouts = []

    def read(trainer, module, callbacks):
        layouts.append(laid_out_like_model(callbacks[0], module))
        return {"model": weights(module), "average": gathered(averaged_state(callbacks[0]))}

    # Validation every 2 steps swaps the averaged weights in and out (Lightning's `_swap_models`).
    val = loader(RegressionData(n=16, seed=5), BATCH)
    result = compare(column, lambda: [EMAWeightAveraging(decay=0.7)], read, val_check_interval=2, val_loader=val)
    return {**result, "laid_out_like_model": layouts[0]}


def swa_case(column: str) -> dict:
    def read(trainer, module, callbacks):
        return {"model": weights(module), "average": gathered(averaged_state(callbacks[0]))}

    def callbacks():
        return [StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=2, annealing_epochs=1)]

    val = loader(RegressionData(n=16, seed=5), BATCH)
    return compare(
        column, callbacks, read, max_steps=-1, max_epochs=3, limit_train_batches=EPOCH_BATCHES, val_loader=val
    )


def resume_case(column: str, make_callback: Callable[[], Any], resume_step: int = 2, **fit_kwargs: Any) -> dict:
    """Fit with a checkpoint at every step; fit again from the middle one; the resumed run's model and averaged
    weights must equal the uninterrupted run's exactly."""
    directory = case_dir(f"resume_{column}_{make_callback().__class__.__name__}")
    checkpoints = ModelCheckpoint(directory, save_top_k=-1, every_n_train_steps=1, filename="{step}")
    whole = make_callback()
    _, module = fit(COLUMNS[column][1](), [whole, checkpoints], BATCH, enable_checkpointing=True, **fit_kwargs)
    want = {"model": weights(module), "average": gathered(averaged_state(whole))}
    resumed = make_callback()
    middle = str(directory / f"step={resume_step}.ckpt")
    _, module = fit(COLUMNS[column][1](), [resumed], BATCH, ckpt_path=middle, **fit_kwargs)
    got = {"model": weights(module), "average": gathered(averaged_state(resumed))}
    return {name: max_diff(got[name], want[name]) for name in want}


def finetuning_case(column: str) -> dict:
    """The backbone unfreezes at epoch 1 and joins the optimizer in a group of its own. Compared with one process on
    the same global batches (DDP never all-reduces parameters that were frozen when it wrapped the model, so its
    ranks' backbones drift apart), and the ranks' copies with each other."""

    def callbacks():
        return [BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_lr=0.02)]

    options = dict(max_steps=-1, max_epochs=3, limit_train_batches=EPOCH_BATCHES)
    _, module = fit(COLUMNS[column][1](), callbacks(), BATCH, **options)
    ours = weights(module)
    _, ddp_module = fit("ddp", callbacks(), ddp_batch(column), **options)
    reference = single_process_fit(column, callbacks(), **options)
    return {
        "model": max_diff(ours, reference),
        "ddp_vs_one_process": max_diff(weights(ddp_module), reference),
        "ddp_rank_spread": rank_spread(ddp_module),
        "rank_spread": rank_spread(module),
    }


def single_process_fit(column: str, callbacks: list, **kwargs: Any) -> dict[str, torch.Tensor]:
    """The same fit on one process (on every rank, no collective), on the column's global batches in Lightning's
    distributed-sampler order."""
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from torch.utils.data import DataLoader, DistributedSampler

    data = RegressionData()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    module = BackboneModule()
    trainer = trainer_for(SingleDeviceStrategy("cpu"), devices=1, callbacks=callbacks, **kwargs)
    trainer.fit(module, DataLoader(data, batch_size=BATCH * data_parallel(column), sampler=sampler))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def rank_spread(module: nn.Module) -> float:
    """The largest difference between ranks' whole copies of the same parameter."""
    local = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() for k, v in module.state_dict().items()
    }
    parts: list[Any] = [None] * world_size()
    dist.all_gather_object(parts, local)
    return max((p[k] - q[k]).abs().max().item() for p in parts for q in parts for k in p if k in q)


def accumulation_case(column: str) -> dict:
    def read(trainer, module, callbacks):
        return {"model": weights(module), "steps": [float(trainer.global_step)]}

    return compare(
        column,
        lambda: [GradientAccumulationScheduler(scheduling={0: 1, 1: 2})],
        read,
        max_steps=-1,
        max_epochs=2,
        limit_train_batches=4,
    )


def lr_monitor_case(column: str) -> dict:
    def read(trainer, module, callbacks):
        (values,) = callbacks[0].lrs.values()
        return {"model": weights(module), "lrs": values}

    return compare(
        column,
        lambda: [LearningRateMonitor(logging_interval="step")],
        read,
        module_kwargs={"step_lr": True},
        logger=CSVLogger(case_dir(f"lr_{column}")),
        log_every_n_steps=1,
    )


def early_stopping_case(column: str) -> dict:
    def read(trainer, module, callbacks):
        return {"model": weights(module), "stopped_at": [float(trainer.global_step)]}

    # Each validation must improve by 10: the second one never does, so training stops after two epochs.
    val = loader(RegressionData(n=16, seed=5), BATCH)
    return compare(
        column,
        lambda: [EarlyStopping(monitor="val_loss", patience=0, min_delta=10.0)],
        read,
        max_steps=-1,
        max_epochs=5,
        limit_train_batches=EPOCH_BATCHES,
        val_loader=val,
    )


def pruning_case(column: str) -> dict:
    def read(trainer, module, callbacks):
        return {"model": weights(module)}

    return compare(
        column,
        lambda: [ModelPruning("l1_unstructured", amount=0.3)],
        read,
        max_steps=-1,
        max_epochs=2,
        limit_train_batches=EPOCH_BATCHES,
    )


CASES: dict[str, Callable[[str], Any]] = {
    "ema": ema_case,
    "ema_resume": lambda column: resume_case(column, lambda: EMAWeightAveraging(decay=0.7)),
    "swa": swa_case,
    "swa_resume": lambda column: resume_case(
        column,
        lambda: StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=1, annealing_epochs=1),
        max_steps=-1,
        max_epochs=3,
        limit_train_batches=EPOCH_BATCHES,
        resume_step=3,
    ),
    "backbone_finetuning": finetuning_case,
    "gradient_accumulation_scheduler": accumulation_case,
    "lr_monitor": lr_monitor_case,
    "early_stopping": early_stopping_case,
    "model_pruning": pruning_case,
}


def column_group(column: str) -> Callable[[], Iterator[Case]]:
    def group() -> Iterator[Case]:
        for name, case in CASES.items():
            yield Case(f"cb_{column}_{name}", functools.partial(case, column))

    return group


GROUPS = {f"cb_{column}": column_group(column) for column in COLUMNS}
