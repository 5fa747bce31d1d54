"""The data-loader hooks (`lightning_dpar.strategies.data_loading`), in process on a fake 4-rank world with tensor
parallelism 2 (mesh logic only): one sampler shard per data-parallel rank, so tensor-parallel peers read the same
batches. Loaders positioned for a mid-epoch resume are in `tests/unit/checkpoint/test_data_position.py`."""

from __future__ import annotations

import pytest
import torch

from lightning_dpar import FSDPTensorParallelStrategy
from lightning_dpar.strategies.data_loading import DataLoaderHooks


@pytest.mark.parametrize(("rank", "data_parallel_rank"), [(0, 0), (1, 0), (2, 1), (3, 1)])
def test_one_sampler_shard_per_data_parallel_rank(fake_world, rank, data_parallel_rank):
    fake_world(4, rank)
    strategy = FSDPTensorParallelStrategy(tensor_parallel_size=2)
    assert isinstance(strategy, DataLoaderHooks) and strategy.is_distributed
    assert strategy.sampler_shards() is None  # the sizes are not known yet
    with pytest.raises(AssertionError, match="the data-parallel mesh is built in `setup_environment`"):
        _ = strategy.distributed_sampler_kwargs
    strategy.dims = strategy.resolve_dims(4, 4, 1)
    strategy.meshes = strategy.dims.build_meshes(torch.device("cpu"))
    assert strategy.sampler_shards() == 2
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": data_parallel_rank}


def test_a_loader_outside_training_is_passed_through_untouched():
    strategy = FSDPTensorParallelStrategy(tensor_parallel_size=2)
    loader = object()  # not even a loader: nothing is checked or positioned outside training
    assert strategy.process_dataloader(loader) is loader
