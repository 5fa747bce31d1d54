"""Cases for `tests/launched/test_errors.py`: bad input through real Trainers on every rank. Each must fail fast with a
message naming the bad value, on all ranks, without hanging the others (the case would time out)."""

from __future__ import annotations

from collections.abc import Iterator

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, ReplicateStrategy
from tests.support.models import ParityModule, RegressionData, loader
from tests.workers.cases import Case
from tests.workers.common import BATCH, trainer_for, world_size


class DDPWrappedModule(ParityModule):
    def configure_model(self):
        if not isinstance(self.model, DistributedDataParallel):
            self.model = DistributedDataParallel(self.model)


def _expect_error(make_trainer, make_module) -> list[str | None]:
    """Every rank's error message (None where it did not raise), gathered on every rank."""
    message = None
    try:
        trainer = make_trainer()
        trainer.fit(make_module(), loader(RegressionData(), BATCH))
    except Exception as err:
        message = f"{type(err).__name__}: {err}"
    messages = [None] * world_size()
    dist.all_gather_object(messages, message)
    return messages


def group_errors() -> Iterator[Case]:
    world = world_size()

    def expect_error(name, make_trainer, make_module=ParityModule):
        return Case(name, lambda: _expect_error(make_trainer, make_module))

    yield expect_error(
        "tp_not_dividing_world",
        lambda: trainer_for(
            FSDPTensorParallelStrategy(tensor_parallel_size=world + 1, tp_plan={"model.out": "colwise"})
        ),
    )
    yield expect_error(
        "replicate_size_not_dividing",
        lambda: trainer_for(FullyShardStrategy(replicate_size=world + 1)),
    )
    yield expect_error(
        "pattern_matches_nothing",
        lambda: trainer_for(
            FSDPTensorParallelStrategy(tensor_parallel_size=world, tp_plan={"model.layers.*.fc9": "colwise"})
        ),
    )
    yield expect_error(
        "style_cannot_shard_module",
        lambda: trainer_for(
            FSDPTensorParallelStrategy(tensor_parallel_size=world, tp_plan={"model.layers.0": "colwise"})
        ),
    )
    yield expect_error(
        "tp_without_plan",
        lambda: trainer_for(FSDPTensorParallelStrategy(tensor_parallel_size=world)),
    )
    yield expect_error("already_wrapped_ddp", lambda: trainer_for("dpar_fsdp"), DDPWrappedModule)
    yield expect_error(
        "ddp_knobs_with_tp",
        lambda: trainer_for(
            ReplicateStrategy(tensor_parallel_size=world, tp_plan={"model.out": "colwise"}, static_graph=True)
        ),
    )


GROUPS = {"errors": group_errors}
