"""Experts' pricing for the layout search: what it reads off a model, the expert-parallel sizes offered, the
parameter groups FSDP shards, and one step's all-to-alls."""

from __future__ import annotations

import torch
from torch import nn

from lightning_dpar.examples.moe import MoE
from lightning_dpar.experts.cost import (
    TOP_K_NAMES,
    MoeShape,
    active_params,
    all_to_all_seconds,
    expert_sizes,
    moe_shape,
    sharded_parameters,
)
from lightning_dpar.parallel_dims import ParallelDims

EP2 = ParallelDims(world_size=8, replicate=1, shard=4, tensor_parallel=2, pipeline=1, expert=2)


def test_the_experts_modules_are_read_off_the_model():
    with torch.device("meta"):
        model = nn.ModuleList([MoE(32, num_experts=4, top_k=2), MoE(32, num_experts=4, top_k=2)])
    experts = sum(p.numel() for layer in model for p in layer.experts.parameters())
    assert moe_shape(model) == MoeShape(experts, 4, 2)
    assert experts < sum(p.numel() for p in model.parameters())  # the routers are dense
    assert moe_shape(nn.Linear(4, 4)) == MoeShape(0, 0, 0)
    assert "top_k" in TOP_K_NAMES


def test_a_token_passes_through_the_dense_parameters_and_k_of_e_experts():
    assert active_params(1000, 800, experts=8, experts_per_token=2) == 200 + 200
    assert active_params(1000, 0, experts=0, experts_per_token=0) == 1000


def test_expert_parallel_sizes_only_for_an_moe_model():
    assert expert_sizes(4, moe=True) == [1, 2, 4]
    assert expert_sizes(4, moe=False) == [1]


def test_fsdp_shards_the_dense_parameters_over_the_shard_dim_and_the_experts_over_what_ep_leaves():
    assert sharded_parameters(1000, 800, EP2) == ((100.0, 4), (400.0, 2))


def test_each_moe_layer_runs_its_all_to_alls_of_the_chosen_hidden_states():
    calls = []

    def ring(collective: str, n: int, nbytes: float, span: int) -> float:
        calls.append((collective, n, nbytes, span))
        return 1.0

    assert all_to_all_seconds(EP2, 8, 2, moe_layers=3, microbatches=2, passes=4, activation=100, ring=ring) == 24
    assert calls == [("all_to_all", 2, 200, 4)]
    assert all_to_all_seconds(EP2, 0, 0, 3, 2, 4, 100, ring) == 0.0  # dense
