"""Features for `tests/launched/test_conformance_callbacks.py`: Lightning's built-in callbacks, the callback rows of the
conformance matrix (`tests/support/conformance_harness.py`). Each feature runs under a strategy column and under its
Lightning DDP reference, and returns what must agree between them: the final weights (`fingerprint`), and the callback's
own
state (averaged weights, logged learning rates, the step training stopped at).

One worker group per column (`callbacks_<column>`, `callbacks_ddp<N>`), each callback a case of it.
"""

from __future__ import annotations

from collections.abc import Callable
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

from lightning_dpar import FullyShardStrategy
from tests.support.conformance_harness import (
    BATCH,
    Column,
    column_groups,
    conformance_trainer,
    fingerprint,
    make_strategy,
)
from tests.support.models import Net, RegressionData, RegressionModule, loader
from tests.workers.checkpoint_common import case_dir
from tests.workers.common import world_size

#: Batches per epoch (epoch-based callbacks: SWA, BackboneFinetuning, GradientAccumulationScheduler).
EPOCH_BATCHES = 2


class BackboneModule(RegressionModule):
    """A backbone (`Net`: a linear, two residual blocks, a linear) and a head; the optimizer takes the trainable
    parameters only, as Lightning's finetuning docs ask."""

    tp_plan = {"backbone.layers.*.fc1": "colwise", "backbone.layers.*.fc2": "rowwise"}

    def __init__(self, lr: float = 0.05, step_lr: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = Net(depth=2)
        self.head = nn.Linear(5, 5)
        self.lr, self.step_lr = lr, step_lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.backbone(x)))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr, momentum=0.9)
        if not self.step_lr:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# ---------------------------------------------------------------------------------------------------- helpers
VAL = dict(n=16, seed=5)


def fit(
    strategy: Any,
    column: Column,
    callbacks: list,
    validate: bool = False,
    ckpt_path: str | None = None,
    module_kwargs: dict | None = None,
    **kwargs: Any,
) -> tuple[L.Trainer, BackboneModule]:
    module = BackboneModule(**(module_kwargs or {}))
    trainer = conformance_trainer(strategy, column, callbacks=callbacks, **kwargs)
    val = loader(RegressionData(**VAL), BATCH) if validate else None
    trainer.fit(module, loader(RegressionData(), BATCH), val, ckpt_path=ckpt_path)
    return trainer, module


def whole(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors of a state dict of DTensors (each pipeline stage's part, merged on every rank); collective."""
    local = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone() for k, v in state.items()}
    parts: list[Any] = [None] * world_size()
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


def as_json(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {k: v.tolist() for k, v in state.items()}


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want), (sorted(got), sorted(want))
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)


def prefixed(average: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"average.{k}": v for k, v in average.items()}


def averaged_state(callback: Any) -> dict[str, torch.Tensor]:
    """The averaged weights a weight-averaging callback holds, keyed like the LightningModule's state dict."""
    average = callback._average_model
    if isinstance(average, torch.optim.swa_utils.AveragedModel):
        return {k[len("module.") :]: v for k, v in average.state_dict().items() if k.startswith("module.")}
    return dict(average.state_dict())


def laid_out_like_model(callback: Any, module: nn.Module) -> bool:
    """Every averaged tensor is of its parameter's kind, a DTensor with the parameter's mesh and placements."""
    averaged = averaged_state(callback)
    for name, parameter in module.named_parameters():
        average = averaged[name]
        if isinstance(parameter, DTensor) != isinstance(average, DTensor):
            return False
        if isinstance(parameter, DTensor) and (average.device_mesh, average.placements) != (
            parameter.device_mesh,
            parameter.placements,
        ):
            return False
    return True


# ---------------------------------------------------------------------------------------------------- features
def ema(strategy: Any, column: Column) -> Any:
    """EMA of the weights; validation every 2 steps runs on the averaged weights (swapped in and out)."""
    callback = EMAWeightAveraging(decay=0.7)
    trainer, module = fit(strategy, column, [callback], validate=True, val_check_interval=2)
    laid_out = laid_out_like_model(callback, module)
    return fingerprint(trainer, average=as_json(whole(averaged_state(callback))), laid_out_like_model=laid_out)


SWA_OPTIONS = dict(max_steps=-1, max_epochs=3, limit_train_batches=EPOCH_BATCHES)


def swa(strategy: Any, column: Column) -> Any:
    """SWA from the second epoch (its SWALR schedule included); validation each epoch."""
    callback = StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=2, annealing_epochs=1)
    trainer, _ = fit(strategy, column, [callback], validate=True, **SWA_OPTIONS)
    return fingerprint(trainer, average=as_json(whole(averaged_state(callback))))


def resumed(
    make_callback: Callable[[], Any], resume_step: int, checkpoint_format: str = "sharded", **options: Any
) -> Callable[[Any, Column], Any]:
    """Fit with a checkpoint after every epoch; fit again from the one of step `resume_step`. The resumed run's
    weights and averaged weights must equal the uninterrupted run's (`resume_gap`) and DDP's. (At an epoch's end:
    Lightning's DDP restarts a plain loader's epoch from its first batch when resumed mid-epoch.)"""

    def make(column: Column) -> Any:
        if column.is_reference or checkpoint_format == "sharded":
            return make_strategy(column.id)
        return FullyShardStrategy(checkpoint_format=checkpoint_format)

    def feature(strategy: Any, column: Column) -> Any:
        if checkpoint_format != "sharded" and column.id not in ("dpar_fsdp", "ddp2"):
            return None  # the row is tested under `dpar_fsdp` only (against `ddp2`)
        strategy = make(column)
        directory = case_dir(f"{type(make_callback()).__name__}_{checkpoint_format}_{column.id}")
        checkpoints = ModelCheckpoint(
            directory, save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=True, filename="{step}"
        )
        callback = make_callback()
        _, module = fit(strategy, column, [callback, checkpoints], enable_checkpointing=True, **options)
        want = {**whole(module.state_dict()), **prefixed(whole(averaged_state(callback)))}
        callback = make_callback()
        middle = str(directory / f"step={resume_step}.ckpt")
        trainer, module = fit(make(column), column, [callback], ckpt_path=middle, **options)
        average = whole(averaged_state(callback))
        got = {**whole(module.state_dict()), **prefixed(average)}
        return fingerprint(trainer, average=as_json(average), resume_gap=max_diff(got, want))

    return feature


def backbone_finetuning(strategy: Any, column: Column) -> Any:
    """The backbone unfreezes at epoch 1 and joins the optimizer in a parameter group of its own.

    The reference is one process on the same global batches, not DDP: DDP never all-reduces the gradients of
    parameters that were frozen when it wrapped the model, so under Lightning's DDP each rank's backbone trains on
    its own batches only and the ranks' weights drift apart (`ddp_rank_spread` below, measured by this feature)."""
    options = dict(max_steps=-1, max_epochs=3, limit_train_batches=EPOCH_BATCHES)

    def callbacks() -> list:
        return [BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_lr=0.02)]

    if column.is_reference:
        ddp_trainer, ddp_module = fit(strategy, column, callbacks(), **options)
        spread = rank_spread(ddp_module)
        state = one_process_fit(column, callbacks(), **options)
        if ddp_trainer.global_rank != 0:
            return None
        return {"state": as_json(state), "rank_spread": 0.0, "ddp_rank_spread": spread}
    trainer, module = fit(strategy, column, callbacks(), **options)
    spread = rank_spread(module)
    state = whole(module.state_dict())
    return None if trainer.global_rank != 0 else {"state": as_json(state), "rank_spread": spread}


def one_process_fit(column: Column, callbacks: list, **kwargs: Any) -> dict[str, torch.Tensor]:
    """The same fit in this process alone (no collective), on the column's global batches in the order Lightning's
    distributed sampler gives them (one permutation, whatever the number of replicas)."""
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from torch.utils.data import DataLoader, DistributedSampler

    data = RegressionData()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    module = BackboneModule()
    trainer = conformance_trainer(SingleDeviceStrategy("cpu"), column, devices=1, callbacks=callbacks, **kwargs)
    trainer.fit(module, DataLoader(data, batch_size=BATCH * column.data_parallel, sampler=sampler))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def rank_spread(module: nn.Module) -> float:
    """The largest difference between ranks' whole copies of the same parameter; collective."""
    state = module.state_dict()
    local = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() for k, v in state.items()}
    parts: list[Any] = [None] * world_size()
    dist.all_gather_object(parts, local)
    return max((p[k] - q[k]).abs().max().item() for p in parts for q in parts for k in p if k in q)


def accumulation_scheduler(strategy: Any, column: Column) -> Any:
    """Accumulate 1 batch in epoch 0, 2 from epoch 1."""
    callback = GradientAccumulationScheduler(scheduling={0: 1, 1: 2})
    trainer, _ = fit(strategy, column, [callback], max_steps=-1, max_epochs=2, limit_train_batches=4)
    return fingerprint(trainer, global_step=trainer.global_step)


def lr_monitor(strategy: Any, column: Column) -> Any:
    """A step-wise StepLR schedule, logged every step."""
    callback = LearningRateMonitor(logging_interval="step")
    logger = CSVLogger(case_dir(f"lr_monitor_{column.id}"))
    trainer, _ = fit(strategy, column, [callback], module_kwargs={"step_lr": True}, logger=logger, log_every_n_steps=1)
    return fingerprint(trainer, lrs=callback.lrs)


def early_stopping(strategy: Any, column: Column) -> Any:
    """Each validation must improve `val_loss` by 10: the second never does, so training stops after 2 epochs."""
    callback = EarlyStopping(monitor="val_loss", patience=0, min_delta=10.0)
    options = dict(max_steps=-1, max_epochs=5, limit_train_batches=EPOCH_BATCHES)
    trainer, _ = fit(strategy, column, [callback], validate=True, **options)
    return fingerprint(trainer, global_step=trainer.global_step, stopped_epoch=callback.stopped_epoch)


def model_pruning(strategy: Any, column: Column) -> Any:
    """L1-unstructured pruning of 30% of the weights after each epoch."""
    callback = ModelPruning("l1_unstructured", amount=0.3)
    trainer, _ = fit(strategy, column, [callback], max_steps=-1, max_epochs=2, limit_train_batches=EPOCH_BATCHES)
    return fingerprint(trainer)


FEATURES: dict[str, Callable[[Any, Column], Any]] = {
    "ema": ema,
    "ema_resume": resumed(
        lambda: EMAWeightAveraging(decay=0.7),
        resume_step=EPOCH_BATCHES,
        max_steps=-1,
        max_epochs=2,
        limit_train_batches=EPOCH_BATCHES,
    ),
    "ema_resume_full": resumed(
        lambda: EMAWeightAveraging(decay=0.7),
        resume_step=EPOCH_BATCHES,
        checkpoint_format="full",
        max_steps=-1,
        max_epochs=2,
        limit_train_batches=EPOCH_BATCHES,
    ),
    "swa": swa,
    "swa_resume": resumed(
        lambda: StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=1, annealing_epochs=1),
        resume_step=2 * EPOCH_BATCHES,
        **SWA_OPTIONS,
    ),
    "backbone_finetuning": backbone_finetuning,
    "gradient_accumulation_scheduler": accumulation_scheduler,
    "lr_monitor": lr_monitor,
    "early_stopping": early_stopping,
    "model_pruning": model_pruning,
}

GROUPS = column_groups("callbacks", FEATURES)
