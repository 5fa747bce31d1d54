"""`ReplicateStrategy`'s own arguments and mesh (`lightning_dpar.strategies.replicate`): what DDP cannot do refused
when the strategy is built, every data-parallel rank a replica. Training under it is in `test_base.py` and the
launched tests."""

from __future__ import annotations

import pytest

from lightning_dpar.strategies.replicate import ReplicateStrategy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"expert_parallel_size": 2}, r"does not split experts \(`expert_parallel_size=2`\)"),
        ({"pipeline_parallel_size": 4}, r"does not pipeline \(`pipeline_parallel_size=4`\)"),
        ({"compiled_autograd": True}, r"`compiled_autograd=True` .* needs `compile=True`"),
        ({"comm_hook": "int8"}, r"`comm_hook='int8'` is unknown"),
    ],
)
def test_what_ddp_cannot_do_is_refused_when_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReplicateStrategy(**kwargs)


def test_every_data_parallel_rank_is_a_replica():
    dims = ReplicateStrategy().resolve_dims(8, 4, 2)
    assert (dims.replicate, dims.shard, dims.tensor_parallel) == (8, 1, 1)
    dims = ReplicateStrategy(tensor_parallel_size=2).resolve_dims(8, 4, 2)
    assert (dims.replicate, dims.shard, dims.tensor_parallel) == (4, 1, 2)


def test_with_tensor_parallelism_the_options_of_ddps_reducer_are_refused_by_name():
    strategy = ReplicateStrategy(tensor_parallel_size=2, static_graph=True, bucket_cap_mb=10, comm_hook="bf16_compress")
    with pytest.raises(ValueError, match=r"\['bucket_cap_mb', 'static_graph'\] configure DDP's bucketed reducer"):
        strategy.resolve_dims(4, 4, 1)
    ReplicateStrategy(tensor_parallel_size=2, comm_hook="fp16_compress").resolve_dims(4, 4, 1)  # a dtype: kept
    ReplicateStrategy(static_graph=True).resolve_dims(4, 4, 1)  # without tensor parallelism DDP takes them
