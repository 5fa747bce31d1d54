"""`lightning_dpar/parallel_dims.py`'s meshes on a fake process group of 8 ranks: the world mesh, its flattened
data-parallel
dim and, with expert parallelism only, the expert view. On torch 2.11 (CI's oldest lane) the expert view goes
through the index form of `DeviceMesh._unflatten`, since 2.11 rejects every dim given by name."""

from __future__ import annotations

import pytest

from lightning_dpar.parallel_dims import (
    DATA_PARALLEL,
    EXPERT,
    EXPERT_SHARD,
    REPLICATE,
    SHARD,
    TENSOR_PARALLEL,
    ParallelDims,
    build_device_mesh,
    expert_fsdp_mesh,
)


def test_without_expert_parallelism_there_is_no_expert_view(fake_world):
    fake_world(8)
    dims = ParallelDims.resolve(8, 8, tensor_parallel_size=2, replicate_size=2)
    mesh, data_parallel, experts, _ = build_device_mesh(dims, "cpu")
    assert mesh.mesh_dim_names == (REPLICATE, SHARD, TENSOR_PARALLEL) and tuple(mesh.shape) == (2, 2, 2)
    assert data_parallel.mesh_dim_names == (DATA_PARALLEL,) and data_parallel.size() == 4
    assert experts is None


@pytest.mark.parametrize(("replicate", "expert", "shapes"), [(1, 2, (1, 2, 2, 2)), (2, 2, (2, 1, 2, 2))])
def test_the_expert_view_splits_the_shard_dim(fake_world, replicate, expert, shapes):
    fake_world(8)
    dims = ParallelDims.resolve(8, 8, tensor_parallel_size=2, replicate_size=replicate, expert_parallel_size=expert)
    mesh, _, experts, _ = build_device_mesh(dims, "cpu")
    assert experts is not None
    assert experts.mesh_dim_names == (REPLICATE, EXPERT_SHARD, EXPERT, TENSOR_PARALLEL)
    assert tuple(experts.shape) == shapes
    assert experts[EXPERT].size() == expert and experts[EXPERT_SHARD].size() == dims.expert_shard
    # The same ranks as the world mesh, viewed differently: an expert peer is a shard peer.
    assert experts[EXPERT].mesh.tolist() == mesh[SHARD].mesh.tolist()[:expert]
    fsdp = expert_fsdp_mesh(experts, dims)
    assert fsdp.ndim == (1 if replicate == 1 else 2)
