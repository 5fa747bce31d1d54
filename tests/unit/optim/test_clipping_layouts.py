"""`lightning_dpar.optim.clipping` in one process: which mesh dims each gradient layout is reduced over (the cache and
the
numbers against torch are in `tests/unit/optim/test_clipping.py`).

A fake process group of 8 ranks supplies the meshes. Its collectives do nothing, so `dist.all_reduce` is replaced by
one that reduces as if every rank of the group held a shard equal to this rank's (a sum multiplies by the group
size, a max changes nothing). The norm of such a gradient is known exactly: its local squared norm times the
number of distinct shards (the product of the sizes of the mesh dims it is sharded over), so reducing a layout over
a replicated dim, missing a sharded one, or mixing two layouts gives a different number.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_dpar.optim.clipping import clip_grad_norm_, total_grad_norm
from lightning_dpar.parallel_dims import is_sharded


class _Holder:
    """A parameter stand-in: clipping reads only `.grad` (and keeps a weak reference to cache the grouping)."""

    __slots__ = ("__weakref__", "grad")

    def __init__(self, grad) -> None:
        self.grad = grad


def _holding(grads) -> list[_Holder]:
    return [_Holder(g) for g in grads]


@pytest.fixture
def mesh(fake_world):
    fake_world(8)
    return init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tensor_parallel"))


@pytest.fixture
def reductions(monkeypatch):
    """Every all-reduce as (group size, op); reduces as if all ranks of the group held this rank's tensor."""
    seen: list[tuple[int, dist.ReduceOp]] = []

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        size = dist.get_world_size(group)
        seen.append((size, op))
        if op == dist.ReduceOp.SUM:
            tensor.mul_(size)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return seen


def _two_d_placements(mesh):
    """The placements FSDP2 over tensor parallelism gives a colwise and a rowwise Linear (built on meta)."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    parallelize_module(model, mesh["tensor_parallel"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(model, mesh=mesh["replicate", "shard"])
    return {name: p for name, p in model.named_parameters()}


def _grad_like(param: DTensor, seed: int) -> DTensor:
    local = torch.randn(param.to_local().shape, generator=torch.Generator().manual_seed(seed))
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _expected_norm(grads, norm_type=2.0) -> float:
    total = 0.0
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        shards = 1
        if isinstance(grad, DTensor):
            shards = math.prod(grad.device_mesh.size(d) for d, p in enumerate(grad.placements) if is_sharded(p))
        total += torch.linalg.vector_norm(local, norm_type).item() ** norm_type * shards
    return total ** (1 / norm_type)


def test_fsdp_over_tensor_parallel_shards_are_reduced_over_both_sharded_dims(mesh, reductions):
    params = _two_d_placements(mesh)
    colwise = params["0.weight"]
    assert "_StridedShard" in type(colwise.placements[1]).__name__  # FSDP's strided shard over the TP shard
    grad = _grad_like(colwise, seed=0)
    norm = total_grad_norm(_holding([grad]))
    assert reductions == [(2, dist.ReduceOp.SUM), (2, dist.ReduceOp.SUM)]  # shard and tensor_parallel, not replicate
    assert norm.item() == pytest.approx(_expected_norm([grad]), rel=1e-6)
    assert norm.item() == pytest.approx(torch.linalg.vector_norm(grad.to_local()).item() * 2, rel=1e-6)


def test_each_layout_is_reduced_on_its_own_and_plain_tensors_not_at_all(mesh, reductions):
    params = _two_d_placements(mesh)
    # Four layouts: strided+TP shard (colwise), shard+TP shard (rowwise weight), shard only (rowwise bias),
    # fully replicated on a 1-D submesh, and a plain tensor whole on every rank.
    replicated = DTensor.from_local(torch.randn(5), mesh["tensor_parallel"], [Replicate()], run_check=False)
    grads = [_grad_like(params[name], seed) for seed, name in enumerate(["0.weight", "1.weight", "1.bias"])]
    grads += [replicated, torch.randn(3)]
    norm = total_grad_norm(_holding(grads))
    assert norm.item() == pytest.approx(_expected_norm(grads), rel=1e-6)
    # 2 + 2 + 1 reductions: one per sharded dim of each layout; none for the replicated or plain tensor.
    assert sorted(size for size, _ in reductions) == [2, 2, 2, 2, 2]


def test_layouts_on_one_mesh_are_not_mixed(mesh, reductions):
    def on_mesh(local, placements):
        return DTensor.from_local(local, mesh, placements, run_check=False)

    grads = [
        on_mesh(torch.randn(4, 3), [Replicate(), Shard(0), Shard(0)]),
        on_mesh(torch.randn(6), [Replicate(), Shard(0), Replicate()]),
        on_mesh(torch.randn(5), [Replicate(), Replicate(), Replicate()]),
    ]
    assert total_grad_norm(_holding(grads)).item() == pytest.approx(_expected_norm(grads), rel=1e-6)
    assert len(reductions) == 3


def test_gradients_of_one_layout_share_one_reduction(mesh, reductions):
    shard_mesh = mesh["shard"]
    shard = DTensor.from_local(torch.randn(4), shard_mesh, [Shard(0)], run_check=False)
    other = DTensor.from_local(torch.randn(6), shard_mesh, [Shard(0)], run_check=False)
    norm = total_grad_norm(_holding([shard, other]))
    assert len(reductions) == 1
    assert norm.item() == pytest.approx(_expected_norm([shard, other]), rel=1e-6)


def test_infinity_norm_takes_the_maximum_over_ranks(mesh, reductions):
    params = _two_d_placements(mesh)
    grads = [_grad_like(params["0.weight"], seed=1), torch.tensor([-7.0, 1.0])]
    norm = total_grad_norm(_holding(grads), norm_type=math.inf)
    assert {op for _, op in reductions} == {dist.ReduceOp.MAX}
    assert norm.item() == 7.0


def test_clip_scales_every_local_shard_to_the_global_max_norm(mesh, reductions):
    params = _two_d_placements(mesh)
    grads = [_grad_like(params["0.weight"], seed=2), _grad_like(params["1.bias"], seed=3)]
    expected = _expected_norm(grads)
    before = [g.to_local().clone() for g in grads]
    total = clip_grad_norm_(_holding(grads), max_norm=1.0)
    assert total.item() == pytest.approx(expected, rel=1e-6) and expected > 1.0
    for grad, old in zip(grads, before):
        torch.testing.assert_close(grad.to_local(), old * (1.0 / (total.item() + 1e-6)), rtol=1e-5, atol=1e-7)
