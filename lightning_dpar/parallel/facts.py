"""What planning finds on the model once, before any step of `lightning_dpar.parallel.parallelize.STEPS` makes its
slice, because several steps read it (`ModelFacts`, found by `model_facts`): whether the model was parallelised by its
own `configure_model`, its repeated blocks and FSDP units, tied parameters, the experts modules, the modules
recomputed in backward and the data-parallel wrapper's top-level units. Each step reads the facts it declares
(`Planning.facts`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from lightning_dpar.activation_checkpointing.step import ActivationCheckpointingPlan, plan_activation_checkpointing
from lightning_dpar.experts.plan import plan_experts
from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.plan.planner import PlanOptions, check_adoptable, expert_selectors, shard_units
from lightning_dpar.plan.selectors import resolve_activation_checkpointing
from lightning_dpar.plan.structure import (
    check_not_wrapped_by_other_parallelism,
    data_parallel_roots,
    has_fully_shard,
    is_parallelized,
    repeated_blocks,
)
from lightning_dpar.plan.ties import TiedGroup, tied_parameters

__all__ = ["ModelFacts", "model_facts"]


@dataclass(frozen=True)
class ModelFacts:
    """What planning finds on the model once, before any step makes its slice, because several steps read it.

    `adopted`: the user parallelised the model in `configure_model` (no tensor, expert or pipeline parallelism and
    no activation checkpointing are added; `adopted_sharded`: it applied `fully_shard` itself, so the data-parallel
    wrapper adds no units). `blocks`: its repeated blocks; `shard_units`: the FSDP units (none for a wrapper that
    does not shard); `tied`: parameters reachable under several names (`lightning_dpar.plan.ties`); `experts`: the
    experts modules expert parallelism splits (tensor parallelism leaves them out); `checkpointing`: the modules
    recomputed in backward and how (context parallelism checks none cuts a block); `roots`: the data-parallel wrapper's
    top-level units (none under pipelining: each stage is its own root)."""

    adopted: bool
    adopted_sharded: bool
    blocks: list[str]
    shard_units: list[str]
    tied: list[TiedGroup]
    experts: list[str]
    checkpointing: ActivationCheckpointingPlan
    roots: list[str]


def model_facts(module: nn.Module, dims: ParallelDims, options: PlanOptions) -> ModelFacts:
    """`module`'s `ModelFacts` on a world of `dims`, refusing what cannot compose (classic DDP / FSDP1 wrappers, a
    model parallelised already by a strategy that does not adopt it) before any step plans."""
    check_not_wrapped_by_other_parallelism(module, options.strategy)
    blocks = repeated_blocks(module)
    units = shard_units(module, options, blocks)
    if is_parallelized(module):
        check_adoptable(module, dims, options)
        sharded = has_fully_shard(module)  # the wrapper adds no units of its own, so needs no top-level units
        roots = [] if sharded else data_parallel_roots(module)
        return ModelFacts(True, sharded, blocks, units, [], [], ActivationCheckpointingPlan(), roots)
    tied = tied_parameters(module)
    experts = plan_experts(module, dims.expert, dims.shard, expert_selectors(module, options))
    checkpointing = plan_activation_checkpointing(
        module,
        options.activation_checkpointing,
        lambda spec: resolve_activation_checkpointing(module, spec, units, blocks),
        options.strategy,
    )
    roots = [] if dims.pipeline > 1 else data_parallel_roots(module)  # refuses containers holding parameters
    return ModelFacts(False, False, blocks, units, tied, list(experts), checkpointing, roots)
