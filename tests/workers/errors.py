"""Bad input through real Trainers on every rank: each must fail fast with a message naming the bad value, on all
ranks, without hanging the others (the launch would time out)."""

from __future__ import annotations

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, ReplicateStrategy
from tests.models import ParityModule, RegressionData, loader
from tests.workers.common import BATCH, trainer_for, world_size


class DDPWrappedModule(ParityModule):
    def configure_model(self):
        if not isinstance(self.model, DistributedDataParallel):
            self.model = DistributedDataParallel(self.model)


class ClassicFSDPWrapped(ParityModule):
    pass


def _expect_error(results, name, make_trainer, make_module):
    message = None
    try:
        trainer = make_trainer()
        trainer.fit(make_module(), loader(RegressionData(), BATCH))
    except Exception as err:
        message = f"{type(err).__name__}: {err}"
    messages = [None] * world_size()
    dist.all_gather_object(messages, message)
    if dist.get_rank() == 0:
        results[name] = messages


def group_errors(results):
    world = world_size()
    _expect_error(
        results,
        "tp_not_dividing_world",
        lambda: trainer_for(
            FSDPTensorParallelStrategy(tensor_parallel_size=world + 1, tp_plan={"model.out": "colwise"})
        ),
        ParityModule,
    )
    _expect_error(
        results,
        "replicate_size_not_dividing",
        lambda: trainer_for(FullyShardStrategy(replicate_size=world + 1)),
        ParityModule,
    )
    _expect_error(
        results,
        "pattern_matches_nothing",
        lambda: trainer_for(
            FSDPTensorParallelStrategy(tensor_parallel_size=world, tp_plan={"model.layers.*.fc9": "colwise"})
        ),
        ParityModule,
    )
    _expect_error(
        results,
        "style_cannot_shard_module",
        lambda: trainer_for(
            FSDPTensorParallelStrategy(tensor_parallel_size=world, tp_plan={"model.layers.0": "colwise"})
        ),
        ParityModule,
    )
    _expect_error(
        results,
        "tp_without_plan",
        lambda: trainer_for(FSDPTensorParallelStrategy(tensor_parallel_size=world)),
        ParityModule,
    )
    _expect_error(results, "already_wrapped_ddp", lambda: trainer_for("dpar_fsdp"), DDPWrappedModule)
    _expect_error(
        results,
        "ddp_knobs_with_tp",
        lambda: trainer_for(
            ReplicateStrategy(tensor_parallel_size=world, tp_plan={"model.out": "colwise"}, static_graph=True)
        ),
        ParityModule,
    )


GROUPS = {"errors": group_errors}
