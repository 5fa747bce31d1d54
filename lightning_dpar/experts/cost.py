"""Experts (mixture-of-experts layers) as the layout search prices them (`lightning_dpar.layout_search`): what it
reads off a model, the expert-parallel sizes it offers, how the parameters shard, and what one step's all-to-alls
cost.

A token passes through every non-expert parameter and `k / E` of the experts (`k` chosen of `E` per MoE layer).
Under expert parallelism FSDP shards the experts over the shard dim's ranks left to each expert-parallel group
(`ParallelDims.expert_shard`) and the rest over the whole shard dim, and each MoE layer runs 4 all-to-alls per
microbatch (dispatch and combine, forward and backward; 6 with activation checkpointing) of each token's `k` chosen
hidden states. The time of one collective is the caller's `ring(collective, n, nbytes, span)`: seconds of one ring
collective over `n` ranks of an `nbytes` buffer, its group spanning `span` ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch import nn

from lightning_dpar.experts.plan import find_experts
from lightning_dpar.helpers import divisors
from lightning_dpar.parallel_dims import ParallelDims

__all__ = [
    "TOP_K_NAMES",
    "MoeShape",
    "active_params",
    "all_to_all_seconds",
    "expert_sizes",
    "moe_shape",
    "sharded_parameters",
]

#: The names a model's config (or a module) gives the experts each token chooses.
TOP_K_NAMES = ("num_experts_per_tok", "experts_per_token", "top_k")


class MoeShape(NamedTuple):
    """A model's experts: the parameters of all experts of all MoE layers, the experts per MoE layer (0: dense) and
    the MoE layers."""

    expert_params: int
    experts: int
    moe_layers: int


def moe_shape(module: nn.Module) -> MoeShape:
    """The experts of `module` (any device, meta included): the modules that follow the experts contract, as the
    planner checks it (`find_experts`). A router may carry `num_experts` and its own `[num_experts, hidden]` weight
    too (DeepSeek-V3's), but not `forward(hidden_states, top_k_index, top_k_weights)`."""
    modules = [module.get_submodule(fqn) for fqn in find_experts(module)]
    expert_params = sum(p.numel() for m in modules for p in m.parameters(recurse=False))
    experts = modules[0].num_experts if modules else 0
    return MoeShape(expert_params if experts else 0, experts, len(modules))


def active_params(params: int, expert_params: int, experts: int, experts_per_token: int) -> int:
    """Parameters one token passes through: every non-expert parameter and `k / E` of the experts (all of `params`
    for a dense model, `experts == 0`)."""
    if not experts:
        return params
    return params - expert_params + expert_params * experts_per_token // experts


def expert_sizes(shard: int, moe: bool) -> list[int]:
    """The expert-parallel sizes the search offers: every divisor of the `shard` ranks for an MoE model, else 1."""
    return divisors(shard) if moe else [1]


def sharded_parameters(params: int, expert_params: int, dims: ParallelDims) -> tuple[tuple[float, int], ...]:
    """`(parameters, FSDP group size)` of one rank's parameter groups: the non-expert parameters of its pipeline
    stage, its tensor-parallel shard, over the shard dim; its expert-parallel share of the experts over the ranks
    left to each expert-parallel group."""
    dense = (params - expert_params) / dims.pipeline / dims.tensor_parallel
    experts = expert_params / dims.pipeline / dims.expert
    return (dense, dims.shard), (experts, dims.expert_shard)


def all_to_all_seconds(
    dims: ParallelDims,
    experts: int,
    experts_per_token: int,
    moe_layers: int,
    microbatches: int,
    passes: int,
    activation: int,
    ring: Callable[..., float],
) -> float:
    """Expert parallelism's all-to-alls of one step (see the module docstring): `moe_layers` on this pipeline rank,
    each running `passes` of them per microbatch, of `activation` bytes (one microbatch's hidden states) times the
    experts each token chooses; 0 for a dense model or without expert parallelism."""
    if not experts or dims.expert == 1:
        return 0.0
    routed = activation * experts_per_token
    span = dims.expert * dims.tensor_parallel
    return moe_layers * microbatches * passes * ring("all_to_all", dims.expert, routed, span)
