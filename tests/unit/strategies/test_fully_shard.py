"""`FullyShardStrategy` and `FSDPTensorParallelStrategy`'s own arguments (`lightning_dpar.strategies.fully_shard`),
checked when the strategy is built; training under them is in `test_base.py` and the launched tests."""

from __future__ import annotations

import pytest
import torch

from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.strategies.fully_shard import FSDPTensorParallelStrategy, FullyShardStrategy


@pytest.mark.parametrize("value", [True, False, 2, 8])
def test_reshard_after_forward_takes_a_bool_or_a_group_size(value):
    FullyShardStrategy(reshard_after_forward=value)


@pytest.mark.parametrize("value", [1, 0, -2, "yes", 2.0])
def test_reshard_after_forward_refuses_anything_else_naming_it(value):
    with pytest.raises(
        ValueError, match=rf"`reshard_after_forward={value!r}` is invalid: use True, False or an int > 1"
    ):
        FullyShardStrategy(reshard_after_forward=value)


def test_cpu_offload_means_no_whole_updates_on_the_device():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    assert FullyShardStrategy(cpu_offload=True).cpu_offload
    assert not FullyShardStrategy(cpu_offload=True)._computes_whole_updates(optimizer)
    assert not FullyShardStrategy().cpu_offload


def test_context_parallelism_refuses_compile_before_any_collective():
    strategy = FullyShardStrategy(compile=True)
    strategy._check_before_collectives(ParallelDims.resolve(4, 4))  # no context parallelism: fine
    with pytest.raises(ValueError, match=r"`FullyShardStrategy\(context_parallel_size=2, compile=True\)`"):
        strategy._check_before_collectives(ParallelDims.resolve(4, 4, context_parallel_size=2))


def test_float8_on_a_cpu_without_emulation_is_refused_before_any_collective():
    pytest.importorskip("torchao.float8")
    strategy = FSDPTensorParallelStrategy(tensor_parallel_size=1, float8="rowwise")
    strategy.parallel_devices = [torch.device("cpu")]
    with pytest.raises(RuntimeError, match=r"`FSDPTensorParallelStrategy\(float8='rowwise'\)` needs float8 matmuls"):
        strategy._check_before_collectives(ParallelDims.resolve(1, 1))
    assert strategy.plan_options.float8.recipe == "rowwise"


def test_the_2d_strategy_defaults_to_one_nodes_devices_for_tensor_parallelism():
    strategy = FSDPTensorParallelStrategy()
    dims = strategy.resolve_dims(16, 4, 4)
    assert (dims.tensor_parallel, dims.shard, dims.replicate) == (4, 4, 1)
    assert FullyShardStrategy().resolve_dims(16, 4, 4).tensor_parallel == 1
