"""Cases of `tests/launched/test_conformance.py`: the Trainer flags, buffers and Tuner rows of the Lightning conformance
matrix, each run under every strategy column and under Lightning's DDP (`tests/support/conformance_harness.py`).

Every feature trains the matrix's small model (`ConformanceModule`, with a BatchNorm) for a few steps on 2 (or 4)
ranks and returns `fingerprint(...)`: the full weights and buffers, each data-parallel rank's buffers, the logged
values, plus what the feature adds (a checkpoint's buffers, predictions, the Tuner's result, files left behind).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from tests.support.conformance_harness import (
    BATCH,
    Column,
    checkpoint_model_state,
    column_groups,
    conformance_module,
    conformance_trainer,
    fingerprint,
)
from tests.support.models import ConformanceModule, RegressionData, loader


def train_data() -> DataLoader:
    return loader(RegressionData(64), BATCH)


def val_data() -> DataLoader:
    return loader(RegressionData(32, seed=5), BATCH)


def shared_dir() -> Path:
    """A temporary directory, the same on every rank (rank 0 makes it)."""
    path = [tempfile.mkdtemp(prefix="conformance-") if not dist.is_initialized() or dist.get_rank() == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(path, 0)
    return Path(path[0])


# ---------------------------------------------------------------------------------------------------- buffers
def buffers(strategy: Any, column: Column) -> Any:
    """BatchNorm's running statistics after training on different batches per rank, validation with them (every 2
    steps: the logged `val_loss` shows whether every rank evaluated with the same statistics), and the buffers a
    checkpoint holds."""
    module = conformance_module(column, batchnorm=True)
    root = shared_dir()
    trainer = conformance_trainer(strategy, column, val_check_interval=2, limit_val_batches=2)
    trainer.fit(module, train_data(), val_data())
    trainer.save_checkpoint(root / "last.ckpt")
    saved = checkpoint_model_state(root / "last.ckpt") if trainer.global_rank == 0 else {}
    names = [n for n, _ in module.named_buffers()]
    return fingerprint(trainer, checkpoint_buffers={k: v for k, v in saved.items() if k in names})


def sync_batchnorm(strategy: Any, column: Column) -> Any:
    module = conformance_module(column, batchnorm=True)
    trainer = conformance_trainer(strategy, column, sync_batchnorm=True)
    trainer.fit(module, train_data())
    return fingerprint(trainer)


# ---------------------------------------------------------------------------------------------------- trainer flags
def fit_with(**trainer_kwargs: Any):
    """A feature that fits the model with these Trainer arguments (and validation data) and fingerprints the run."""

    def feature(strategy: Any, column: Column) -> Any:
        trainer = conformance_trainer(strategy, column, **trainer_kwargs)
        trainer.fit(conformance_module(column), train_data(), val_data())
        return fingerprint(trainer)

    return feature


class ReloadingModule(ConformanceModule):
    """Builds its loaders itself, a new one each epoch under `reload_dataloaders_every_n_epochs=1`: each epoch's
    data comes from another seed, so a loader not rebuilt shows."""

    def train_dataloader(self) -> DataLoader:
        return loader(RegressionData(16, seed=100 + self.current_epoch), BATCH)

    def val_dataloader(self) -> DataLoader:
        return loader(RegressionData(16, seed=200 + self.current_epoch), BATCH)


def reload_dataloaders(strategy: Any, column: Column) -> Any:
    module = ReloadingModule(batchnorm=column.id not in ("pipeline", "ddp1"))
    trainer = conformance_trainer(strategy, column, max_steps=-1, max_epochs=3, reload_dataloaders_every_n_epochs=1)
    trainer.fit(module)
    return fingerprint(trainer, epochs=trainer.current_epoch)


class OwnSamplerModule(ConformanceModule):
    """Its training loader's `DistributedSampler` built in `train_dataloader` (once the processes exist): over the
    data-parallel ranks (`distributed_sampler_kwargs`), or over the world (`DistributedSampler(data)`)."""

    def __init__(self, batchnorm: bool, over_data_parallel: bool) -> None:
        super().__init__(batchnorm=batchnorm)
        self.over_data_parallel = over_data_parallel

    def train_dataloader(self) -> DataLoader:
        data = RegressionData(64)
        kwargs = self.trainer.strategy.distributed_sampler_kwargs if self.over_data_parallel else {}
        return DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, shuffle=True, seed=3, **kwargs))


def own_sampler(over_data_parallel: bool):
    """`use_distributed_sampler=False` with the user's own `DistributedSampler`: over the data-parallel ranks, as
    the docs tell users to build it (also what Lightning's DDP has), or a plain `DistributedSampler(data)`, which
    shards over the world: the data-parallel group only without tensor or pipeline parallelism."""

    def feature(strategy: Any, column: Column) -> Any:
        trainer = conformance_trainer(strategy, column, use_distributed_sampler=False)
        trainer.fit(OwnSamplerModule(column.id not in ("pipeline", "ddp1"), over_data_parallel))
        return fingerprint(trainer)

    return feature


def validate_and_predict(**trainer_kwargs: Any):
    """Fit, then `validate` and `predict(return_predictions=True)`: every rank's predictions, by data-parallel
    rank (tensor-parallel peers and pipeline stages return the same)."""

    def feature(strategy: Any, column: Column) -> Any:
        trainer = conformance_trainer(strategy, column, **trainer_kwargs)
        module = conformance_module(column)
        trainer.fit(module, train_data())
        validated = trainer.validate(module, val_data(), verbose=False)
        predictions = trainer.predict(module, val_data(), return_predictions=True)
        local = torch.cat(predictions).tolist() if predictions else None
        gathered = [None] * trainer.world_size
        dist.all_gather_object(gathered, (trainer.strategy.distributed_sampler_kwargs["rank"], local))
        by_rank = {str(r): p for r, p in gathered if p is not None}
        return fingerprint(trainer, validated=validated, predictions=by_rank)

    return feature


# ------------------------------------------------------------------------------------------ manual optimisation
class ManualModule(ConformanceModule):
    """Manual optimisation with two optimizers (the input layer and norm; the rest), `manual_backward`, and a
    second backward accumulated into the first optimizer's gradients before its step."""

    def __init__(self, batchnorm: bool = True) -> None:
        super().__init__(batchnorm=batchnorm)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        x, y = batch
        loss = F.mse_loss(self(x), y)
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        second.step()
        self.manual_backward(F.mse_loss(self(x), y) * 0.5)
        first.step()
        self.log("train_loss", loss, sync_dist=True)

    def configure_optimizers(self):
        head = [p for n, p in self.named_parameters() if n.startswith(("model.inp", "model.norm"))]
        rest = [p for n, p in self.named_parameters() if not n.startswith(("model.inp", "model.norm"))]
        return torch.optim.SGD(head, lr=0.05, momentum=0.9), torch.optim.Adam(rest, lr=0.01)


def manual_optimization(strategy: Any, column: Column) -> Any:
    trainer = conformance_trainer(strategy, column)
    trainer.fit(ManualModule(batchnorm=column.id not in ("pipeline", "ddp1")), train_data())
    return fingerprint(trainer)


# ---------------------------------------------------------------------------------------------------- the Tuner
def left_behind(root: Path) -> list[str]:
    """Every rank's files under `root` (relative), gathered."""
    local = sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return sorted({name for names in gathered for name in names})


def lr_find(strategy: Any, column: Column) -> Any:
    from lightning.pytorch.tuner import Tuner

    root = shared_dir()
    trainer = conformance_trainer(strategy, column, default_root_dir=str(root), max_steps=-1, max_epochs=1)
    module = conformance_module(column)
    finder = Tuner(trainer).lr_find(module, train_data(), num_training=6, min_lr=1e-3, max_lr=0.5, update_attr=True)
    after_search = left_behind(root)
    trainer.fit(module, train_data())
    return fingerprint(
        trainer, lrs=finder.results["lr"], losses=finder.results["loss"], lr=module.lr, left_behind=after_search
    )


class BatchSizeModule(ConformanceModule):
    def __init__(self, batchnorm: bool) -> None:
        super().__init__(batchnorm=batchnorm)
        self.batch_size = 2

    def train_dataloader(self) -> DataLoader:
        return loader(RegressionData(64), self.batch_size)


def scale_batch_size(strategy: Any, column: Column) -> Any:
    from lightning.pytorch.tuner import Tuner

    root = shared_dir()
    trainer = conformance_trainer(strategy, column, default_root_dir=str(root), max_steps=-1, max_epochs=1)
    module = BatchSizeModule(batchnorm=column.id not in ("pipeline", "ddp1"))
    found = Tuner(trainer).scale_batch_size(module, mode="power", steps_per_trial=1, init_val=2, max_trials=2)
    after_search = left_behind(root)
    trainer.fit(module)
    return fingerprint(trainer, batch_size=found, left_behind=after_search)


FEATURES = {
    "buffers": buffers,
    "sync_batchnorm": sync_batchnorm,
    "gradient_clip_value": fit_with(gradient_clip_val=0.05, gradient_clip_algorithm="value"),
    "detect_anomaly": fit_with(detect_anomaly=True),
    "deterministic": fit_with(deterministic=True),
    "overfit_batches": fit_with(overfit_batches=2, max_steps=-1, max_epochs=2),
    "limit_train_batches": fit_with(limit_train_batches=3, max_steps=-1, max_epochs=2, limit_val_batches=2),
    "val_check_interval": fit_with(val_check_interval=0.25, limit_val_batches=2, max_steps=-1, max_epochs=1),
    "reload_dataloaders_every_n_epochs": reload_dataloaders,
    "use_distributed_sampler_false": own_sampler(over_data_parallel=True),
    "use_distributed_sampler_false_world_sampler": own_sampler(over_data_parallel=False),
    "inference_mode_false": validate_and_predict(inference_mode=False),
    "predict_return_predictions": validate_and_predict(),
    "barebones": fit_with(
        barebones=True, logger=None, enable_checkpointing=None, enable_progress_bar=None, enable_model_summary=None
    ),
    "manual_optimization": manual_optimization,
    "lr_find": lr_find,
    "scale_batch_size": scale_batch_size,
}

GROUPS = column_groups("conformance", FEATURES)
