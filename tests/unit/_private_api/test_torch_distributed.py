"""torch.distributed's private names (`lightning_dpar._private_api.torch_distributed`) on a fake process group or one
gloo rank: a torch upgrade that moves or changes one fails here first."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from lightning_dpar._private_api.torch_distributed import (
    AsyncCollectiveTensor,
    checkpoint_activations,
    ddp_replicate,
    flatten_mesh,
    forget_inherited_process_groups,
    functional_all_reduce,
    is_composable_replicated,
    local_shape_and_offset,
    unflatten_mesh,
    waited,
)


def test_a_flattened_mesh_is_found_by_name_and_an_unflattened_dim_splits_in_place(fake_world):
    fake_world(8, rank=5)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    flat = flatten_mesh(mesh["replicate", "shard"], "data_parallel")
    assert flat.size() == 8 and flat.get_local_rank() == 5
    with warnings.catch_warnings():  # torch 2.13 announces it will stop resolving the name from the root mesh
        warnings.filterwarnings("ignore", "Slicing a flattened dim", UserWarning)
        found = mesh["data_parallel"]  # what Lightning users' `self.device_mesh["data_parallel"]` does
    assert found.mesh_dim_names == ("data_parallel",) and found.mesh.tolist() == list(range(8))
    split = unflatten_mesh(mesh, "shard", (2, 2), ("expert_shard", "expert"))
    assert split.mesh_dim_names == ("replicate", "expert_shard", "expert")
    assert split.mesh.tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert (split["expert_shard"].get_local_rank(), split["expert"].get_local_rank()) == (0, 1)  # rank 5 = 4 + 0*2 + 1


def test_the_local_shard_of_an_uneven_tensor(fake_world):
    fake_world(4, rank=3)
    mesh = init_device_mesh("cpu", (4,))
    # 10 rows over 4 ranks: torch's chunks of ceil(10 / 4) = 3, the last rank holds the 1 left
    assert local_shape_and_offset((10, 3), mesh, [Shard(0)]) == ((1, 3), (9, 0))
    assert local_shape_and_offset((10, 3), mesh, [Replicate()]) == ((10, 3), (0, 0))


def test_forgetting_the_process_groups_leaves_none_and_a_new_one_can_start(fake_world):
    from lightning_dpar.parallel_dims import init_fake_process_group

    fake_world(2)
    inherited = dist.group.WORLD
    forget_inherited_process_groups()
    assert not dist.is_initialized()
    init_fake_process_group(0, 3)
    assert dist.get_world_size() == 3 and dist.group.WORLD is not inherited


def test_waited_gives_plain_tensors_with_their_autograd_history(gloo_world):
    x = torch.ones(3, requires_grad=True)
    reduced = functional_all_reduce(x * 2, "sum", dist.group.WORLD)
    assert isinstance(reduced, AsyncCollectiveTensor)
    plain = waited(reduced)
    assert not isinstance(plain, AsyncCollectiveTensor) and torch.equal(plain, torch.full((3,), 2.0))
    plain.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    pair = waited((functional_all_reduce(torch.ones(1), "sum", dist.group.WORLD), "label"))
    assert type(pair) is tuple and not isinstance(pair[0], AsyncCollectiveTensor) and pair[1] == "label"
    other = [torch.ones(1)]
    assert waited(other) is other and waited("x") == "x"


def test_composable_replicate_is_recorded_on_the_module(gloo_world):
    replicated, plain = nn.Linear(2, 2), nn.Linear(2, 2)
    ddp_replicate(replicated)
    assert is_composable_replicated(replicated) and not is_composable_replicated(plain)


def test_composable_checkpointing_recomputes_the_forward_in_backward_and_keeps_the_names():
    calls = []

    class Counted(nn.Linear):
        def forward(self, x):
            calls.append(1)
            return super().forward(x).relu()

    module = Counted(3, 3)
    names = [name for name, _ in module.named_parameters()]
    checkpoint_activations(module)
    assert [name for name, _ in module.named_parameters()] == names
    module(torch.randn(2, 3, requires_grad=True)).sum().backward()
    assert len(calls) == 2
