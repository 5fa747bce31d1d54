"""`lightning_dpar.estimates.state_memory` in one process: the per-rank estimate from real sharded parameters.

A two-layer model gets tensor parallelism and FSDP2 on meta tensors, on a fake process group of 8 ranks (mesh
replicate 2 x shard 2 x tensor_parallel 2): the placements are exactly what training produces, and nothing is
allocated. Expected numbers are counted by hand from the shapes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_dpar.estimates.state_memory import estimate_memory, optimizer_states, unsharded_numel
from lightning_dpar.helpers import local_numel
from lightning_dpar.parallel_dims import TENSOR_PARALLEL


@pytest.fixture
def model(fake_world):
    """Linear(8, 16) colwise + Linear(16, 8) rowwise, then FSDP over (replicate, shard)."""
    fake_world(8)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", TENSOR_PARALLEL))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    parallelize_module(model, mesh[TENSOR_PARALLEL], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(model, mesh=mesh["replicate", "shard"])
    return model


# Each weight has 128 elements: split 2 ways by TP and 2 ways by FSDP's shard dim (replicate keeps copies), so a
# rank holds 32; a bias is split by the shard dim, and by TP only when colwise. Shapes: (global, local).
LOCAL = {"0.weight": 32, "0.bias": 4, "1.weight": 32, "1.bias": 4}


def test_local_elements_are_this_ranks_shard(model):
    assert {name: local_numel(p) for name, p in model.named_parameters()} == LOCAL
    assert local_numel(torch.empty(3, 5, device="meta")) == 15


def test_all_gathering_all_but_some_dims_counts_fsdp_strided_shards(model):
    params = dict(model.named_parameters())
    colwise = params["0.weight"]  # FSDP's strided shard over the tensor-parallel shard
    assert "_StridedShard" in type(colwise.placements[1]).__name__
    # FSDP's all-gather keeps the tensor-parallel split: half of the weight.
    assert unsharded_numel(colwise, [TENSOR_PARALLEL]) == 64
    # Keeping every sharded dim sharded leaves exactly this rank's shard; gathering everything, the whole weight.
    assert unsharded_numel(colwise, ["shard", TENSOR_PARALLEL]) == LOCAL["0.weight"]
    assert unsharded_numel(colwise, []) == 128
    # The replicate dim holds copies: keeping it changes nothing.
    assert unsharded_numel(params["1.bias"], ["replicate", "shard"]) == LOCAL["1.bias"]
    assert unsharded_numel(torch.empty(4, 4), ["shard"]) == 16


@pytest.mark.parametrize(
    ("make", "states"),
    [
        (lambda p: torch.optim.Adam(p), 2),
        (lambda p: torch.optim.AdamW(p, amsgrad=True), 3),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1),
        (lambda p: torch.optim.SGD(p, lr=0.1), 0),
        (lambda p: torch.optim.RMSprop(p, momentum=0.9, centered=True), 3),
    ],
)
def test_states_per_element_follow_each_param_groups_options(make, states):
    params = [nn.Parameter(torch.empty(2, device="meta"))]
    (entry,) = optimizer_states([make(params)])
    assert entry.states == states and entry.params == tuple(params)


def test_estimate_counts_parameters_trainable_gradients_and_optimizer_state(model):
    model[1].bias.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    estimate = estimate_memory(model, [torch.optim.Adam(trainable)])
    fp32 = 4
    assert estimate.parameters == 72 * fp32  # 32 + 4 + 32 + 4 local elements
    assert estimate.gradients == 68 * fp32  # the frozen bias has no gradient
    assert estimate.optimizer == 2 * 68 * fp32  # exp_avg and exp_avg_sq of the trainable ones
    assert estimate.total == (72 + 68 + 2 * 68) * fp32


def test_bf16_parameters_halve_every_term(model):
    model.to(torch.bfloat16)
    estimate = estimate_memory(model, [torch.optim.Adam(model.parameters())])
    assert (estimate.parameters, estimate.gradients, estimate.optimizer) == (72 * 2, 72 * 2, 2 * 72 * 2)


def test_an_unknown_optimizer_leaves_the_optimizer_term_unknown(model):
    class Lion(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

    estimate = estimate_memory(model, [torch.optim.SGD(model.parameters(), lr=0.1), Lion(model.parameters())])
    assert estimate.optimizer is None and estimate.unknown_optimizers == ("Lion",)
    assert estimate.total == estimate.parameters + estimate.gradients
