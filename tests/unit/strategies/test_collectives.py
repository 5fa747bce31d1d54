"""The collective hooks (`lightning_dpar.strategies.collectives`), in process: without a process group each is the
identity; on a fake 4-rank world with tensor parallelism 2 (mesh logic only) the data-parallel group is resolved
once per mesh and given to the model's torchmetrics. Real collectives on one gloo rank are in `test_base.py`, on
several in the launched tests."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchmetrics.aggregation import SumMetric

from lightning_dpar import FSDPTensorParallelStrategy
from lightning_dpar.strategies.collectives import Collectives


def test_without_a_process_group_the_collectives_return_what_they_were_given():
    strategy = FSDPTensorParallelStrategy(tensor_parallel_size=2)
    assert isinstance(strategy, Collectives)
    assert strategy.data_parallel_group is None  # no mesh yet
    payload = {"a": [1, 2]}
    assert strategy.broadcast(payload) is payload
    assert strategy.reduce_boolean_decision(True) and not strategy.reduce_boolean_decision(False, all=False)
    assert strategy.reduce("not a tensor") == "not a tensor"
    strategy.barrier("anything")  # no group: returns at once


def test_the_data_parallel_group_is_resolved_once_per_mesh_and_given_to_the_metrics(fake_world):
    fake_world(4, rank=3)
    strategy = FSDPTensorParallelStrategy(tensor_parallel_size=2)
    strategy.meshes = strategy.resolve_dims(4, 4, 1).build_meshes(torch.device("cpu"))
    group = strategy.data_parallel_group
    assert dist.get_process_group_ranks(group) == [1, 3]  # rank 3's tensor-parallel coordinate is 1
    assert strategy.data_parallel_group is group
    model = nn.Module()
    model.metric, model.nested = SumMetric(), nn.ModuleList([SumMetric()])
    strategy.sync_metrics_over_data_parallel(model)
    assert model.metric.process_group is group and model.nested[0].process_group is group
    strategy.meshes = strategy.resolve_dims(4, 4, 1).build_meshes(torch.device("cpu"))  # a new mesh: looked up anew
    assert dist.get_process_group_ranks(strategy.data_parallel_group) == [1, 3]
    assert strategy._data_parallel_group_of[0] is strategy.meshes.data_parallel
