"""Lightning's data-loader hooks, as one mixin of `DparStrategy`: the distributed sampler's shard (one per
data-parallel rank, so tensor-parallel and pipeline peers see the same batches), and the training loader checked and
positioned for a mid-epoch resume by the checkpoint manager."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from typing_extensions import override

from lightning_dpar.conformance.sampler_check import check_sampler_shards
from lightning_dpar.helpers import attached_trainer
from lightning_dpar.parallel_dims import ParallelMeshes

if TYPE_CHECKING:
    from lightning_dpar.checkpoint.manager import CheckpointManager
    from lightning_dpar.parallel_dims import ParallelDims
    from lightning_dpar.steps.contract import StepRunner

__all__ = ["LIGHTNING_RESUME_WARNING", "DataLoaderHooks"]

#: Lightning's warning on a mid-epoch resume whose loader has no `state_dict`; ours resumes without one.
LIGHTNING_RESUME_WARNING = "You're resuming from a checkpoint that ended before the epoch ended"


class DataLoaderHooks(ParallelStrategy):
    """The data-loader hooks of `DparStrategy`, which sets the state they read (in `setup_environment` and `setup`)."""

    checkpoints: CheckpointManager
    dims: ParallelDims | None
    meshes: ParallelMeshes | None
    _runner: StepRunner | None

    @property
    def is_distributed(self) -> bool:
        # Lightning only inserts a DistributedSampler for strategies that say so; without it every rank would
        # silently train on the same batches.
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        mesh = self.meshes.data_parallel if self.meshes is not None else None
        assert mesh is not None, "the data-parallel mesh is built in `setup_environment`"
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}

    def sampler_shards(self) -> int | None:
        """Into how many shards the training sampler splits the data (the data-parallel size; more when other
        launches train other shards, as fault-tolerant replica groups do); None before the mesh sizes are known."""
        return self.dims.data_parallel if self.dims is not None else None

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Make the training loader resumable mid-epoch and position it if a checkpoint was just loaded."""
        trainer = attached_trainer(self.lightning_module)
        if trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        if self._runner is not None:
            self._runner.check_batches(dataloader)  # before training, not at the epoch's last batch
        data_parallel = self.sampler_shards()
        if data_parallel is not None:
            check_sampler_shards(dataloader, data_parallel, self.world_size)
        if self.checkpoints.resumes_mid_epoch():
            # Lightning judges resumability by the loader's own `state_dict`, which ours does not need; the one line
            # the checkpoint manager logs in `on_train_start` says whether this resume is exact instead.
            warnings.filterwarnings("ignore", message=LIGHTNING_RESUME_WARNING, category=PossibleUserWarning)
        self.checkpoints.position_loader(dataloader, data_parallel)
        return dataloader
