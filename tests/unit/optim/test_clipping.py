"""`GradientClipper`: the same numbers as `torch.nn.utils` on whole tensors, and its cached grouping of parameters
rebuilt whenever the parameters with gradients change (another model, a second `fit`, a parameter left without a
gradient). In-process, on a one-rank gloo group; the multi-rank sums are covered by the parity tests
(`tests/test_training.py`, `*_clip_*`)."""

from __future__ import annotations

import gc
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from lightning_dpar.optim.clipping import GradientClipper


@pytest.fixture
def one_rank_group():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _params(seed: int, shapes=((4, 3), (5,), (2, 2, 2))) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = nn.Parameter(torch.randn(*shape, generator=g))
        p.grad = torch.randn(*shape, generator=g)
        params.append(p)
    return params


def _reference_norm(params, norm_type=2.0) -> float:
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in params if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads, norm_type))


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_norm_and_clip_match_torch_on_whole_tensors(norm_type):
    params = _params(0)
    expected = [p.detach().clone() for p in params]
    for p, e in zip(params, expected):
        e.grad = p.grad.clone()
    norm = GradientClipper().clip_grad_norm_(params, max_norm=0.5, norm_type=norm_type)
    torch_norm = torch.nn.utils.clip_grad_norm_(expected, max_norm=0.5, norm_type=norm_type)
    assert float(norm) == pytest.approx(float(torch_norm), rel=1e-6)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.grad, e.grad, rtol=1e-6, atol=1e-7)


def test_clip_value_matches_torch():
    params = _params(1)
    expected = [p.grad.clone().clamp_(-0.3, 0.3) for p in params]
    GradientClipper().clip_grad_value_(params, 0.3)
    for p, e in zip(params, expected):
        assert torch.equal(p.grad, e)


def test_bf16_gradients_are_normed_in_fp32():
    params = _params(2)
    for i, p in enumerate(params):
        bf16 = nn.Parameter(p.detach().to(torch.bfloat16))  # bf16-true: bf16 parameters and gradients
        bf16.grad = p.grad.to(torch.bfloat16)
        params[i] = bf16
    exact = math.sqrt(sum(float(p.grad.float().pow(2).sum()) for p in params))
    assert float(GradientClipper().total_norm(params)) == pytest.approx(exact, rel=1e-6)


def test_cached_grouping_follows_the_parameters():
    clipper = GradientClipper()
    first = _params(3)
    assert float(clipper.total_norm(first)) == pytest.approx(_reference_norm(first), rel=1e-6)
    layout = clipper._layout
    # Same parameters, new gradients (every step): the grouping is reused.
    for p in first:
        p.grad = p.grad * 2
    assert float(clipper.total_norm(first)) == pytest.approx(_reference_norm(first), rel=1e-6)
    assert clipper._layout is layout
    # A parameter without a gradient this step: regrouped, and it is left out.
    first[1].grad = None
    assert float(clipper.total_norm(first)) == pytest.approx(_reference_norm(first), rel=1e-6)
    assert clipper._layout is not layout
    # Another model (a second fit with new parameters), possibly reusing the freed parameters' ids.
    del first
    gc.collect()
    second = _params(4, shapes=((3, 3), (7,)))
    assert float(clipper.total_norm(second)) == pytest.approx(_reference_norm(second), rel=1e-6)
    assert len(clipper._layout.params) == 2


def test_dtensor_gradients_on_different_meshes_and_placements(one_rank_group):
    """Groups per (mesh, placements), plain tensors in a group of their own; the norm is the full vector's."""
    mesh_2d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("shard", "tensor_parallel"))
    mesh_1d = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    g = torch.Generator().manual_seed(5)
    params = []
    for mesh, placements, shape in (
        (mesh_2d, (Shard(0), Shard(1)), (4, 6)),
        (mesh_2d, (Shard(0), Replicate()), (6,)),
        (mesh_1d, (Shard(0),), (3, 3)),
        (None, None, (5,)),
    ):
        full, grad = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
        if mesh is None:
            p = nn.Parameter(full)
            p.grad = grad
        else:
            p = nn.Parameter(distribute_tensor(full, mesh, placements))
            p.grad = distribute_tensor(grad, mesh, placements)
        params.append(p)
    clipper = GradientClipper()
    expected = _reference_norm(params)
    full_grads = [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone() for p in params]
    norm = clipper.clip_grad_norm_(params, max_norm=1.0)
    assert float(norm) == pytest.approx(expected, rel=1e-6)
    assert len(clipper._layout.groups) == 4
    scale = min(1.0, 1.0 / (expected + 1e-6))
    for p, full in zip(params, full_grads):
        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(got, full * scale, rtol=1e-6, atol=1e-7)


def test_a_pipeline_stage_without_gradients_still_takes_part_in_the_norm(gloo_world):
    """A stage whose parameters all lack gradients (frozen) contributes zero to the norm summed over the stages,
    instead of skipping the collective the other stages wait in."""
    import torch.distributed as dist

    from lightning_dpar.optim.clipping import GradientClipper

    group = dist.new_group([0])
    frozen = torch.nn.Linear(2, 2)
    clipper = GradientClipper(across=(group,), device=torch.device("cpu"))
    assert clipper.total_norm(frozen.parameters()).item() == 0.0


def test_a_stage_without_gradients_reduces_its_norm_on_the_stages_device_not_cpu(fake_world):
    """That zero is reduced on the stage's device (NCCL reduces device tensors only), not on CPU. The device here is
    `meta`, a device other than CPU that needs no accelerator, over a fake 2-rank group (whose collectives accept any
    device): on a CPU device the old code, which always used CPU, passed too."""
    import torch.distributed as dist

    from lightning_dpar.optim.clipping import GradientClipper

    fake_world(2)
    group = dist.new_group([0, 1])
    clipper = GradientClipper(across=(group,), device=torch.device("meta"))
    norm = clipper.total_norm(torch.nn.Linear(2, 2).requires_grad_(False).parameters())
    assert norm.device == torch.device("meta") and norm.shape == ()


def test_equal_meshes_held_as_different_objects_group_together(one_rank_group):
    """Parameters of one FSDP mesh can hold different but equal `DeviceMesh` objects (found by the sweep: after
    other Trainers ran in the process, a model's head held a mesh object of its own). Grouping by object split them
    in two groups, summing the squared norms in another order, so the same run clipped differently depending on what
    ran before (2.0e-4 on its parameters after Muon's bfloat16 step, `tests/unit/test_sweep.py`). Equal meshes reduce
    over the same ranks: one group, the same arithmetic whichever objects the parameters hold."""
    first = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    second = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    assert first is not second and first == second

    def params(meshes):
        g = torch.Generator().manual_seed(6)
        out = []
        for mesh, shape in zip(meshes, [(13, 14), (14, 13), (5, 13), (17, 13)]):
            full, grad = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
            p = nn.Parameter(distribute_tensor(full, mesh, (Shard(0),)))
            p.grad = distribute_tensor(grad, mesh, (Shard(0),))
            out.append(p)
        return out

    one_object = GradientClipper()
    two_objects = GradientClipper()
    same = one_object.total_norm(params([first] * 4))
    mixed = two_objects.total_norm(params([first, first, first, second]))
    assert len(two_objects._layout.groups) == 1
    assert torch.equal(same, mixed)
