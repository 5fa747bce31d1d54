"""The default process group (`lightning_dpar/launch/process_group.py`), in-process: a strategy with no group to adopt
starts a real one-rank gloo group, and the hook it registers for the process's exit ends that group and never one the
user created. The exit itself (no abort at interpreter shutdown) is `tests/launched/test_launch.py`."""

from __future__ import annotations

import torch.distributed as dist

from lightning_dpar import FullyShardStrategy
from lightning_dpar.launch.process_group import _destroy_at_exit
from tests.support.models import ParityModule, RegressionData, loader
from tests.workers.common import BATCH, trainer_for


def test_the_strategy_starts_a_group_and_its_exit_hook_ends_only_that_one():
    assert not dist.is_initialized()
    try:
        trainer = trainer_for(FullyShardStrategy(), max_steps=1, devices=1)
        trainer.fit(ParityModule(), loader(RegressionData(n=8), BATCH))
        assert dist.is_initialized() and dist.get_backend() == "gloo" and dist.get_world_size() == 1
        started = dist.group.WORLD
        _destroy_at_exit(object())  # a group that is not the default one any more: left alone
        assert dist.is_initialized()
        _destroy_at_exit(started)
        assert not dist.is_initialized()
        _destroy_at_exit(started)  # already ended (e.g. by the user): nothing to do
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
