"""The module plan, as data: which modules get which tensor-parallel style, which are activation-checkpointed,
compiled and FSDP units, and, with pipeline parallelism, the split into stages and the part of the plan one rank
applies (`local_plan`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_dpar.activation_checkpointing.step import CheckpointPolicyName
from lightning_dpar.helpers import is_under
from lightning_dpar.pipeline.split import PipelineSplit

__all__ = ["DataParallelSettings", "ModulePlan", "local_plan"]

#: The data-parallel wrappers: FSDP2 over the FSDP mesh, composable DDP, or FSDP2 over a shard group of size 1
#: (replicas with tensor-parallel parameters, which DDP's reducer cannot hold).
DataParallelWrapperName = Literal["fully_shard", "replicate", "fully_shard_replicas"]


@dataclass(frozen=True)
class DataParallelSettings:
    """How the data-parallel step wraps the model: the strategy's arguments, frozen into the plan so the step reads
    them from the plan (training and the dry run alike) instead of calling back into the strategy.

    `wrapper` names the wrapper; `reshard_after_forward` and `cpu_offload` are `fully_shard`'s; `ddp_kwargs` and
    `comm_hook` are composable `replicate`'s; `reduce_dtype` overrides the mixed-precision policy's gradient
    reduction dtype (`comm_hook="bf16_compress"` with tensor parallelism).
    """

    wrapper: DataParallelWrapperName = "fully_shard"
    reshard_after_forward: bool | int = True
    cpu_offload: bool = False
    ddp_kwargs: Mapping[str, Any] = field(default_factory=dict)
    comm_hook: Callable[..., Any] | None = None
    reduce_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class ModulePlan:
    """What will be applied to which module, in application order (TP, activation checkpointing, compile, FSDP).

    `adopted` marks a model the user parallelised in `configure_model`: no TP or activation checkpointing is added.
    With pipeline parallelism, `pipeline` is the split into stages and the other entries name only the modules of
    `pipeline_rank`'s stages (the split is applied first). `tied` lists the parameters reachable under several names
    (tied embeddings, a module shared by several blocks), found on the model before any parallelism: each stays one
    parameter (see `lightning_dpar.plan.ties`).

    Facts the data-parallel wrapper needs are found here too, once, so no wrapper reads them off the model again:
    `data_parallel_roots` are the top-level units it wraps (`plan.structure.data_parallel_roots`; planned for a model
    neither adopted nor pipelined), `ignored` the modules whose gradients are not synchronised (`ignored_modules`,
    `dpar_replicate`), and `adopted_sharded` marks an adopted model whose `configure_model` applied `fully_shard`
    itself, so the wrapper adds no FSDP units of its own.

    `experts` are the experts modules whose experts are split between the expert-parallel ranks
    (`lightning_dpar.experts.plan`); each is also an FSDP unit of its own, sharded over the ranks that hold the same
    experts.

    `context_parallel` names the blocks each sequence is split across under context parallelism, in order
    (`lightning_dpar.context_parallel.sequence_blocks`); empty without it. With pipeline parallelism it still names
    every block of the model (where the sequence is split and gathered again); the hooks go on `pipeline_rank`'s.
    `context_parallel_loss` names the transformers causal LM whose loss each rank computes on its own tokens
    (`context_parallel_loss="per_rank"`, `lightning_dpar.context_parallel.loss`); `None`: the last block's output is
    gathered whole.

    `data_parallel` says how the data-parallel step wraps the model (`DataParallelSettings`).

    `activation_checkpointing_policy` says how the `activation_checkpointing` modules are recomputed: `"full"` or
    `"selective"` (`lightning_dpar.activation_checkpointing`).

    `loss_parallel` names the output layer whose logits stay sharded over the vocabulary under tensor parallelism
    (`loss_parallel=True`, `lightning_dpar.loss_parallel`): the tensor-parallel step gives it a vocabulary-sharded
    style in place of its planned gathered one; `None`: the logits are gathered whole.

    `float8` names the `nn.Linear` modules converted to torchao's `Float8Linear` (`float8=`,
    `lightning_dpar.float8`), in module order, and `float8_config` is torchao's `Float8LinearConfig` for them; empty
    and `None` without float8.
    """

    tensor_parallel: dict[str, ParallelStyle]
    activation_checkpointing: list[str]
    shard_units: list[str]
    compile_units: list[str] = field(default_factory=list)
    adopted: bool = False
    pipeline: PipelineSplit | None = None
    pipeline_rank: int = 0
    tied: list[tuple[str, ...]] = field(default_factory=list)
    data_parallel_roots: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    adopted_sharded: bool = False
    experts: list[str] = field(default_factory=list)
    context_parallel: list[str] = field(default_factory=list)
    context_parallel_loss: str | None = None
    data_parallel: DataParallelSettings = field(default_factory=DataParallelSettings)
    activation_checkpointing_policy: CheckpointPolicyName = "full"
    loss_parallel: str | None = None
    float8: list[str] = field(default_factory=list)
    float8_config: Any = None


def local_plan(plan: ModulePlan, split: PipelineSplit, pipeline_rank: int) -> ModulePlan:
    """`plan` (resolved on the whole model) restricted to the modules of `pipeline_rank`'s stages, with every unit of
    those stages an FSDP unit: units are what stages are made of, and each stage's FSDP root holds exactly them."""
    units = split.units_of_rank(pipeline_rank)
    return replace(
        plan,
        tensor_parallel={fqn: style for fqn, style in plan.tensor_parallel.items() if is_under(fqn, units)},
        activation_checkpointing=[fqn for fqn in plan.activation_checkpointing if is_under(fqn, units)],
        shard_units=list(dict.fromkeys([*units, *(fqn for fqn in plan.shard_units if is_under(fqn, units))])),
        compile_units=[fqn for fqn in plan.compile_units if is_under(fqn, units)],
        pipeline=split,
        pipeline_rank=pipeline_rank,
        tied=[group for group in plan.tied if all(is_under(name, units) for name in group)],
        experts=[fqn for fqn in plan.experts if is_under(fqn, units)],
        float8=[fqn for fqn in plan.float8 if is_under(fqn, units)],
        data_parallel_roots=[],  # each stage's root is its FSDP root
        ignored=[],
    )
