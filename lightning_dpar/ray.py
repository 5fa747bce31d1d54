"""Running the strategies under Ray Train: `prepare_trainer` and a report callback that hands Ray the sharded
checkpoint. See `docs/ray.md`.

Ray's Lightning recipe (`TorchTrainer` + `RayLightningEnvironment` + `prepare_trainer` + `RayTrainReportCallback`)
works with one change: `prepare_trainer` and the callback come from here. Ray's `prepare_trainer` accepts only its own
strategy classes, and Ray's callback has each worker save into its own local directory, which a sharded checkpoint
(every rank writes its shards to one directory) cannot do across nodes.

`ray` is an optional dependency: it is imported inside the functions below, so the package imports without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback

from lightning_dpar.strategies.base import DparStrategy

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import pyarrow.fs
    from ray.train import Checkpoint

__all__ = ["RayTrainReportCallback", "checkpoint_url", "latest_checkpoint", "prepare_trainer"]


def prepare_trainer(trainer: pl.Trainer) -> pl.Trainer:
    """Ready `trainer` (built with a `lightning_dpar` strategy and Ray's `RayLightningEnvironment`) to run in this
    Ray Train worker; call it inside the training function, where `ray.train.lightning.prepare_trainer` would be.

    Each Ray worker sees only its own device and is told its local rank, so the strategy's devices are set to the
    worker group's: one per worker of this node, this worker's (`ray.train.torch.get_device()`) at its local rank,
    and the number of nodes to the group's. Refused before any collective: another strategy, another cluster
    environment, nodes with different numbers of workers, ranks not contiguous per node (the mesh puts a node's
    ranks in one tensor-parallel group), and Ray's own report callback with sharded checkpoints.
    """
    import ray.train
    import ray.train.torch
    from ray.train.lightning import RayLightningEnvironment, RayTrainReportCallback

    strategy = trainer.strategy
    if not isinstance(strategy, DparStrategy):
        raise TypeError(
            f"`lightning_dpar.ray.prepare_trainer` prepares the lightning_dpar strategies, not"
            f" {type(strategy).__name__}. For Ray's own strategies (RayDDPStrategy, RayFSDPStrategy, ...) use"
            " `ray.train.lightning.prepare_trainer`."
        )
    environment = strategy.cluster_environment
    if not isinstance(environment, RayLightningEnvironment):
        raise TypeError(
            f"The Trainer's cluster environment is {type(environment).__name__}; under Ray Train it must be"
            " `ray.train.lightning.RayLightningEnvironment()`: pass `Trainer(plugins=[RayLightningEnvironment()])`."
        )
    if strategy.checkpoints.format.name == "sharded" and any(
        type(c) is RayTrainReportCallback for c in trainer.callbacks
    ):
        raise TypeError(
            "Ray's `RayTrainReportCallback` has each worker save into a local directory of its own, but a sharded"
            " checkpoint is one directory into which every worker writes its shards (across nodes, shards would be"
            " lost, and with `async_save` Ray would keep a checkpoint still being written). Use"
            " `lightning_dpar.ray.RayTrainReportCallback()`, which writes the shards straight into the run's storage"
            " and reports that directory, or `checkpoint_format='full'`."
        )
    context = ray.train.get_context()
    if hasattr(strategy, "fault_tolerance"):  # one torchft replica group of a `TorchftConfig` run
        from lightning_dpar.fault_tolerance.ray_groups import prepare_replica_group

        prepare_replica_group(trainer, ray.train.torch.get_device(), context.get_world_rank(), context.get_world_size())
        return trainer
    world_size, local_world_size = context.get_world_size(), context.get_local_world_size()
    rank, local_rank, node_rank = context.get_world_rank(), context.get_local_rank(), context.get_node_rank()
    if world_size % local_world_size or rank != node_rank * local_world_size + local_rank:
        raise ValueError(
            f"This Ray worker is rank {rank} of {world_size}, local rank {local_rank} of {local_world_size} on node"
            f" {node_rank}: the lightning_dpar strategies need the same number of workers on every node, numbered"
            " node by node. Start a number of workers that fills whole nodes (`ScalingConfig(num_workers=...,"
            " resources_per_worker=...)`), e.g. one per GPU of every node."
        )
    device = ray.train.torch.get_device()
    accelerator_type = _accelerator_device_type(trainer)
    if device.type != accelerator_type:
        raise ValueError(
            f"This Ray worker was given the device {device} (`ScalingConfig(use_gpu=...)`), but the Trainer's"
            f" accelerator runs on {accelerator_type!r}. Make them agree: `use_gpu=True` with"
            " `Trainer(accelerator='gpu')`, or `use_gpu=False` with `Trainer(accelerator='cpu')`."
        )
    # Only this worker's own entry (at its local rank) and the count are read: a worker cannot see the others'.
    strategy.parallel_devices = [device] * local_world_size
    strategy.num_nodes = world_size // local_world_size
    return trainer


def _accelerator_device_type(trainer: pl.Trainer) -> str:
    from lightning.pytorch.accelerators import CPUAccelerator

    return "cpu" if isinstance(trainer.accelerator, CPUAccelerator) else "cuda"


class RayTrainReportCallback(Callback):
    """Report metrics and the sharded checkpoint to Ray Train: every `every_n_train_steps` optimizer steps, or at the
    end of each training epoch when that is None (as Ray's `RayTrainReportCallback`).

    Each report saves through the strategy (`trainer.save_checkpoint`: every worker writes only its shards, straight
    into `<storage_path>/<run name>/epoch=E-step=S`, the directory Ray then keeps), waits until the checkpoint is
    complete (an `async_save` one too), and calls `ray.train.report` on every worker with that directory and
    `CheckpointUploadMode.NO_UPLOAD`: nothing is copied. `RunConfig(storage_path=...)` must therefore be a
    filesystem every worker writes to (shared, or an object store such as `s3://`), as Ray requires on more than one
    node anyway. `CheckpointConfig(num_to_keep=...)` removes old checkpoints as with any Ray checkpoint.

    Resume with `trainer.fit(model, ckpt_path=lightning_dpar.ray.latest_checkpoint())`: after Ray restarts the
    worker group, training continues at the batch after the reported checkpoint's.

    Args:
        every_n_train_steps: report every this many optimizer steps; None: at the end of each training epoch.
        dirname: the checkpoint directory's name, formatted with `epoch` and `step`; unique within the run.
    """

    def __init__(self, every_n_train_steps: int | None = None, dirname: str = "epoch={epoch}-step={step}") -> None:
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"`every_n_train_steps={every_n_train_steps}` must be a positive integer or None.")
        self.every_n_train_steps = every_n_train_steps
        self.dirname = dirname
        #: As `ModelCheckpoint`'s: nothing is reported before the first optimizer step, nor twice for one step (with
        #: gradient accumulation several batches end on one step; the first of them is the one after the step).
        self._last_reported_step = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if self.every_n_train_steps is not None and step % self.every_n_train_steps == 0:
            self._report(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.every_n_train_steps is None:
            self._report(trainer)

    def _report(self, trainer: pl.Trainer) -> None:
        import ray.train
        from ray.train import Checkpoint, CheckpointUploadMode

        step = trainer.global_step
        if step == self._last_reported_step:
            return
        self._last_reported_step = step
        storage = ray.train.get_context().get_storage()  # Ray's DeveloperAPI for the run's storage
        name = self.dirname.format(epoch=trainer.current_epoch, step=step)
        path = storage.build_checkpoint_path_from_name(name)
        trainer.save_checkpoint(checkpoint_url(path, storage.storage_filesystem), weights_only=False)
        strategy = trainer.strategy
        if isinstance(strategy, DparStrategy):
            strategy.wait_for_checkpoint()  # Ray must only keep a complete checkpoint
        metrics = {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in trainer.callback_metrics.items()}
        metrics.update(epoch=trainer.current_epoch, step=step)
        ray.train.report(
            metrics,
            checkpoint=Checkpoint(path, filesystem=storage.storage_filesystem),
            checkpoint_dir_name=name,
            checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
        )


def checkpoint_url(path: str, filesystem: pyarrow.fs.FileSystem) -> str:
    """The path or fsspec URL under which the strategies read and write `path` of Ray's pyarrow `filesystem`."""
    import pyarrow.fs

    if isinstance(filesystem, pyarrow.fs.LocalFileSystem):
        return path
    if isinstance(filesystem, pyarrow.fs.PyFileSystem) and isinstance(filesystem.handler, pyarrow.fs.FSSpecHandler):
        return filesystem.handler.fs.unstrip_protocol(path)
    return f"{filesystem.type_name}://{path}"  # s3, gcs, hdfs: fsspec's protocols of the same names


def latest_checkpoint(checkpoint: Checkpoint | None = None) -> str | None:
    """The path (or URL) to pass as `fit(ckpt_path=...)`: of `checkpoint`, by default of the latest checkpoint this run
    reported (`ray.train.get_checkpoint()`, after Ray restarted the workers or resumed the run); None if there is
    none. Outside Ray, `checkpoint_url(result.checkpoint.path, result.checkpoint.filesystem)` does the same."""
    if checkpoint is None:
        import ray.train

        checkpoint = ray.train.get_checkpoint()
    return None if checkpoint is None else checkpoint_url(checkpoint.path, checkpoint.filesystem)
