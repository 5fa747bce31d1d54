"""`lightning_dpar/parallel_dims.py`'s meshes on a fake process group of 8 ranks: the world mesh, its flattened
data-parallel dim and, with expert parallelism only, the expert view. On torch 2.11 (CI's oldest lane) the expert view
goes through the index form of `DeviceMesh._unflatten`, since 2.11 rejects every dim given by name."""

from __future__ import annotations

import pytest
import torch

from lightning_dpar.parallel_dims import (
    DATA_PARALLEL,
    EXPERT,
    EXPERT_SHARD,
    REPLICATE,
    SHARD,
    TENSOR_PARALLEL,
    ParallelDims,
)


def test_without_expert_parallelism_there_is_no_expert_view(fake_world):
    fake_world(8)
    dims = ParallelDims.resolve(8, 8, tensor_parallel_size=2, replicate_size=2)
    meshes = dims.build_meshes(torch.device("cpu"))
    mesh, data_parallel = meshes.world, meshes.data_parallel
    assert mesh.mesh_dim_names == (REPLICATE, SHARD, TENSOR_PARALLEL) and tuple(mesh.shape) == (2, 2, 2)
    assert data_parallel.mesh_dim_names == (DATA_PARALLEL,) and data_parallel.size() == 4
    assert meshes.expert_view is None and meshes.expert is None and meshes.expert_fsdp is None
    # Every other mesh a step needs, handed out by the same object.
    assert meshes.tensor_parallel.mesh_dim_names == (TENSOR_PARALLEL,) and meshes.tensor_parallel.size() == 2
    assert meshes.fsdp.mesh_dim_names == (REPLICATE, SHARD) and tuple(meshes.fsdp.shape) == (2, 2)
    assert meshes.replicate_shard.mesh_dim_names == (REPLICATE, SHARD)


def test_plain_fsdp_shards_over_the_shard_dim_alone(fake_world):
    fake_world(4)
    meshes = ParallelDims.resolve(4, 4, tensor_parallel_size=2).build_meshes(torch.device("cpu"))
    assert meshes.fsdp.mesh_dim_names == (SHARD,) and meshes.fsdp.size() == 2


@pytest.mark.parametrize(("replicate", "expert", "shapes"), [(1, 2, (1, 2, 2, 2)), (2, 2, (2, 1, 2, 2))])
def test_the_expert_view_splits_the_shard_dim(fake_world, replicate, expert, shapes):
    fake_world(8)
    dims = ParallelDims.resolve(8, 8, tensor_parallel_size=2, replicate_size=replicate, expert_parallel_size=expert)
    meshes = dims.build_meshes(torch.device("cpu"))
    mesh, experts = meshes.world, meshes.expert_view
    assert experts is not None
    assert experts.mesh_dim_names == (REPLICATE, EXPERT_SHARD, EXPERT, TENSOR_PARALLEL)
    assert tuple(experts.shape) == shapes
    assert experts[EXPERT].size() == expert and experts[EXPERT_SHARD].size() == dims.expert_shard
    # The same ranks as the world mesh, viewed differently: an expert peer is a shard peer.
    assert experts[EXPERT].mesh.tolist() == mesh[SHARD].mesh.tolist()[:expert]
    assert meshes.expert is not None and meshes.expert.mesh.tolist() == experts[EXPERT].mesh.tolist()
    fsdp = meshes.expert_fsdp
    assert fsdp is not None
    assert fsdp.ndim == (1 if replicate == 1 else 2)


def test_meshes_are_built_once_per_layout_and_default_group(fake_world):
    """torch keeps every process group it creates until the process exits: a second Trainer of the same layout in
    one process reuses the meshes (and their groups) instead of adding more; a new default group builds new ones."""
    fake_world(4)
    dims = ParallelDims.resolve(4, 4, tensor_parallel_size=2)
    first = dims.build_meshes(torch.device("cpu"))
    assert ParallelDims.resolve(4, 4, tensor_parallel_size=2).build_meshes(torch.device("cpu")) is first
    other = ParallelDims.resolve(4, 4, tensor_parallel_size=4).build_meshes(torch.device("cpu"))
    assert other is not first and other.tensor_parallel.size() == 4
    assert dims.build_meshes(torch.device("meta"), device_type="cpu") is not first  # another device: its own meshes
    torch.distributed.destroy_process_group()
    fake_world(4)
    rebuilt = dims.build_meshes(torch.device("cpu"))
    assert rebuilt is not first and rebuilt.fsdp.size() == 2
    assert rebuilt.fsdp.get_group() is not None  # its groups belong to the new default group
