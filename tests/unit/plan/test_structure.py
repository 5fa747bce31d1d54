"""The structure planning reads off ordinary models (`lightning_dpar.plan.structure`), in-process: containers are
never wrapped, their items are, under every strategy. Training such models on 2 and 4 gloo ranks is in
`tests/launched/test_plan_apply.py` (cases in `tests/workers/plan_apply.py`)."""

from __future__ import annotations

import pytest
import torch

import lightning_dpar
from lightning_dpar.estimates import plan
from lightning_dpar.plan.structure import data_parallel_roots
from tests.workers.plan_apply import TopLevelBlocks


def test_containers_are_never_wrapped_their_items_are():
    assert data_parallel_roots(TopLevelBlocks()) == ["inp", "layers.0", "layers.1", "heads.out"]


@pytest.mark.parametrize("strategy", ["dpar_replicate", "dpar_fsdp", "dpar_2d"])
def test_plan_of_top_level_blocks_wraps_no_container(strategy):
    with torch.device("meta"):
        module = TopLevelBlocks()
    trainer_strategy = lightning_dpar.FSDPTensorParallelStrategy(tensor_parallel_size=2)
    if strategy == "dpar_replicate":
        trainer_strategy = lightning_dpar.ReplicateStrategy()
    elif strategy == "dpar_fsdp":
        trainer_strategy = lightning_dpar.FullyShardStrategy()
    report = plan(trainer_strategy, module, world_size=4)
    assert "layers" not in report.modules and "heads" not in report.modules
    assert any("layers.0" == name for name in report.modules)
