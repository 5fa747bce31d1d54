"""What context parallelism refuses, each before the first collective it would need: settings it does not compose
with, a model whose blocks or attention it cannot split, and batches carrying an attention mask. The refusals name
the bad value or module, say what is supported, and how to fix it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from lightning_dpar._private_api import transformers_attention_implementation, transformers_supports_sdpa
from lightning_dpar.helpers import has_parameters, is_under

__all__ = [
    "block_runs",
    "check_batch",
    "check_checkpointed_modules",
    "check_model",
    "check_pipeline_split",
    "check_settings",
    "sequence_blocks",
]


def check_settings(strategy: str, context: int, compile_options: object) -> None:
    """Refuse the strategy settings context parallelism does not compose with yet (`compile_options`: the strategy's
    `torch.compile` options, `None` without compiling; `compile=True` is `{}`)."""
    refused = {"compile": (compile_options or True) if compile_options is not None else None}
    for name, value in refused.items():
        if value is not None:
            raise ValueError(
                f"`{strategy}(context_parallel_size={context}, {name}={value!r})` is not supported yet: context"
                f" parallelism splits the sequence with hooks on the eager blocks, and intercepts their attention in"
                f" ways these settings bypass (docs/context_parallel.md, Limits). Drop `{name}`, or set"
                " `context_parallel_size=1`."
            )


def sequence_blocks(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks the sequence is split across: the children (holding parameters) of the model's one outermost
    `nn.ModuleList` of repeated blocks, in order (experts lists inside the blocks are not outermost)."""
    lists = [(name, m) for name, m in root.named_modules() if isinstance(m, nn.ModuleList) and has_parameters(m)]
    outermost = [(n, m) for n, m in lists if not any(n.startswith(f"{o}.") for o, _ in lists if o != n)]
    if len(outermost) != 1:
        found = [n for n, _ in outermost] or "none"
        raise ValueError(
            f"Context parallelism splits the sequence at a model's repeated blocks, one `nn.ModuleList` of transformer"
            f" layers called in order; {type(root).__name__} has {found}. Hold the layers in one `nn.ModuleList`, or"
            " set `context_parallel_size=1`."
        )
    prefix, blocks = outermost[0]
    return [(f"{prefix}.{name}", block) for name, block in blocks.named_children() if has_parameters(block)]


def block_runs(blocks: Sequence[str], stages: Sequence[Sequence[str]] | None = None) -> list[list[str]]:
    """The runs of consecutive `blocks` (the model's, in order) that run together: all of them without pipeline
    parallelism; with it, per stage of this rank (`stages`: each stage's units) the blocks it holds (a unit is a
    block or inside one; `check_pipeline_split` refuses a block cut between stages). A stage holding no block
    (only an embedding or a head) has no run. Two of a rank's stages that adjoin stay two runs: each stage's
    forward is a call of its own, between which the schedule runs others."""
    if stages is None:
        return [list(blocks)]
    runs = [[block for block in blocks if any(is_under(unit, [block]) for unit in units)] for units in stages]
    return [run for run in runs if run]


def check_pipeline_split(blocks: Sequence[str], stages: Sequence[Sequence[str]]) -> None:
    """Refuse a pipeline split that puts parts of one block (units inside it, `shard_modules` finer than the blocks)
    on different stages: context parallelism splits the sequence at the blocks' inputs and outputs, and a stage
    holding half a block would run the other half on a sequence it has not split."""
    for block in blocks:
        found = sorted({s for s, units in enumerate(stages) for unit in units if is_under(unit, [block])})
        if len(found) > 1:
            raise ValueError(
                f"The pipeline split puts parts of block {block!r} on stages {found}: with context parallelism every"
                " block the sequence is split across must run whole on one stage. Split between blocks"
                " (`pipeline_split` naming blocks, or `shard_modules` no finer than the blocks), or set"
                " `context_parallel_size=1`."
            )


def check_checkpointed_modules(blocks: list[str], checkpointed: list[str]) -> None:
    """Refuse activation checkpointing of a module enclosing the blocks the sequence is split across: its
    recomputation in backward would run the blocks unsplit. The blocks themselves, and modules inside or outside
    them, are recomputed exactly (`ContextParallel.checkpoint_contexts`)."""
    for fqn in checkpointed:
        enclosed = [block for block in blocks if fqn == "" or block.startswith(f"{fqn}.")]
        if enclosed:
            raise ValueError(
                f"`activation_checkpointing` selects {fqn or '(the root)'!r}, which encloses the blocks"
                f" {enclosed[:2]}{' ...' if len(enclosed) > 2 else ''} that context parallelism splits the sequence"
                " across: recomputed in backward, they would run on the whole sequence. Checkpoint the blocks"
                " themselves (`activation_checkpointing=True`, or their class name), or set"
                " `context_parallel_size=1`."
            )


def check_model(root: nn.Module) -> None:
    """Refuse a model whose blocks cannot be found, a transformers model whose attention does not call
    `scaled_dot_product_attention` (`attn_implementation` other than `"sdpa"`), or one that adds its MoE router's
    load-balancing loss (computed from each rank's part of the sequence), naming the module."""
    sequence_blocks(root)
    for name, module in root.named_modules():
        implementation = transformers_attention_implementation(module)
        if getattr(getattr(module, "config", None), "output_router_logits", False):
            raise ValueError(
                f"Module {name or '(root)'!r} ({type(module).__name__}) adds its router's load-balancing loss"
                " (`output_router_logits=True`), which transformers computes from the router logits of the tokens"
                " each rank holds: under context parallelism that is a part of the sequence, not the batch. Set"
                " `output_router_logits=False` (the experts train exactly without it), or `context_parallel_size=1`."
            )
        if implementation is not None and implementation != "sdpa":
            fix = (
                "Build the model with `attn_implementation='sdpa'`"
                if transformers_supports_sdpa(module)
                else f"transformers has no SDPA attention for {type(module).__name__}: train a family that has one"
            )
            raise ValueError(
                f"Module {name or '(root)'!r} ({type(module).__name__}) uses attn_implementation={implementation!r};"
                f" context parallelism makes attention that calls torch's scaled_dot_product_attention"
                f" context-parallel. {fix}, or set `context_parallel_size=1`."
            )


def check_batch(batch: Any) -> None:
    """Refuse a batch carrying an `attention_mask` that masks any token: context parallelism supports causal and
    full attention only (see `attention.SUPPORTED`)."""
    if not isinstance(batch, Mapping):
        return
    mask = batch.get("attention_mask")
    if isinstance(mask, Tensor) and not bool(mask.all()):
        raise ValueError(
            "The batch's `attention_mask` masks some tokens (padding or packed documents): context parallelism"
            " supports causal and full attention without a mask. Train on unpadded sequences of equal length and"
            " drop `attention_mask` (or make it all ones), or set `context_parallel_size=1`."
        )
