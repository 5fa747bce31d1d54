"""Context parallelism as one step of the parallelisation (`lightning_dpar.parallel.parallelize.STEPS`): its slice of
the plan (`plan_context_parallel`), how it is applied (`apply_context_parallel`), and what it does around each step
(`around_step`). Everything else outside this folder knows of it is its mesh dim (`ParallelDims.context`) and its
option (`context_parallel_loss`)."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn

import lightning_dpar.context_parallel.checks as checks
from lightning_dpar.context_parallel.loss import causal_lm_loss_module, check_loss_mode
from lightning_dpar.context_parallel.runtime import ContextParallel
from lightning_dpar.parallel_dims import ParallelDims, ParallelMeshes

__all__ = ["ContextParallelPlan", "apply_context_parallel", "around_step", "plan_context_parallel"]


@dataclass(frozen=True)
class ContextParallelPlan:
    """The blocks each sequence is split across, in order (every block of the model, also with pipeline
    parallelism: the hooks need its first and last), and with `context_parallel_loss="per_rank"` the causal LM whose
    loss each rank computes on its own tokens (`None`: the last block's output is gathered whole). Empty: no context
    parallelism."""

    blocks: list[str] = field(default_factory=list)
    loss_module: str | None = None


def plan_context_parallel(
    module: nn.Module,
    dims: ParallelDims,
    loss_mode: str,
    strategy: str,
    checkpointed: Sequence[str],
    stages: Sequence[Sequence[str]] | None,
) -> ContextParallelPlan:
    """The step's slice of the plan, with every refusal before the first collective: a model whose blocks or
    attention cannot be split, an activation-checkpointed module cutting a block, a pipeline split cutting one, and
    the per-rank loss across pipeline stages (`stages`: each stage's units; `None` without pipelining)."""
    if dims.context == 1:
        return ContextParallelPlan()
    per_rank = check_loss_mode(loss_mode) == "per_rank"
    if per_rank and stages is not None:
        raise ValueError(
            f"`{strategy}(pipeline_parallel_size={dims.pipeline}, context_parallel_size={dims.context},"
            " context_parallel_loss='per_rank')` is not supported yet: the per-rank loss is not implemented across"
            " pipeline stages. Use `context_parallel_loss='whole'` (the default, exact for any loss) with pipelining,"
            " or `pipeline_parallel_size=1`."
        )
    checks.check_model(module)
    blocks = [name for name, _ in checks.sequence_blocks(module)]
    checks.check_checkpointed_modules(blocks, checkpointed)
    if stages is not None:
        checks.check_pipeline_split(blocks, stages)
    return ContextParallelPlan(blocks, causal_lm_loss_module(module, blocks) if per_rank else None)


def apply_context_parallel(
    root: nn.Module,
    part: ContextParallelPlan,
    meshes: ParallelMeshes,
    stages: Sequence[Sequence[str]] | None = None,
) -> ContextParallel | None:
    """The hooks on `root`'s blocks that split each sequence over `meshes.context` (`stages`: this rank's pipeline
    stages' units; the other stages' blocks are remote units); `None` without context parallelism."""
    if not part.blocks:
        return None
    assert meshes.context is not None, "a context-parallel plan needs the context-parallel mesh"
    return ContextParallel.install(root, meshes.context.get_group(), part.blocks, part.loss_module, stages)


@contextmanager
def around_step(runtime: ContextParallel, training: bool, args: Sequence[Any]) -> Generator[None, None, None]:
    """Around each step's forward: a training batch checked first (no masked tokens, before the step's first
    collective), then each sequence split across the context-parallel ranks."""
    if training and args:
        checks.check_batch(args[0])
    with runtime.active():
        yield
