"""Activation memory per rank by a formula: what the layout search falls back on for a model whose training step
cannot be traced on fake tensors (`lightning_dpar.estimates.activations` counts activations for every other model).

Per transformer layer and microbatch of `b` sequences of `s` tokens, width `h`, `a` heads, tensor-parallel size `t`
and activation element size `e` bytes, what backward keeps (Korthikanti et al., "Reducing Activation Recomputation in
Large Transformer Models", 2022, section 4.1, without sequence parallelism; their 16-bit count, 10 + 24/t bytes per
`s*b*h`, is `e * (5 + 12/t)` at `e = 2`):

    layer(b) = s*b*h*e*(5 + 12/t)  +  [5*a*s*s*b*e/(2*t) when attention scores are materialised]

The attention-score term is left out when `flash_attention` (fused attention keeps no `s x s` matrix; torch's SDPA
on CPU and CUDA does so for these models). With activation checkpointing each layer keeps only its input, `s*b*h*e`,
and one layer is recomputed whole during its backward. On top, once per rank:

- the embeddings' output, `s*b*h*e`;
- the logits of the last stage: `3 * s*b*V*4` (fp32 logits, their log-softmax in the loss, and their gradient),
  for every microbatch under GPipe (all forwards run before the first backward); over `t` under loss parallel
  (`loss_parallel`: each rank keeps its vocabulary shard of all three).

The first pipeline rank holds the activations of the microbatches its schedule keeps in flight on each of its stages
(`ScheduleSpec.microbatches_in_flight`; every microbatch for a schedule it does not model), each for the stage's
`layers / (p * v)` layers. The logits are counted on that same rank, which over-counts a little with pipelining
(they live on the last stage), on the safe side.
"""

from __future__ import annotations

from lightning_dpar.pipeline.schedule import schedule_spec

__all__ = ["activation_bytes"]


def activation_bytes(
    *,
    layers: int,
    hidden: int,
    heads: int,
    vocab: int,
    seq_len: int,
    microbatch_size: int,
    element_size: int,
    tensor_parallel: int = 1,
    pipeline: int = 1,
    microbatches: int = 1,
    schedule: str | None = None,
    stages_per_rank: int = 1,
    checkpointing: bool = False,
    flash_attention: bool = True,
    loss_parallel: bool = False,
) -> int:
    """Peak activation bytes of one rank (see the module docstring for the formula and what it assumes)."""
    s, b, h, e, t = seq_len, microbatch_size, hidden, element_size, tensor_parallel
    full_layer = s * b * h * e * (5 + 12 / t)
    if not flash_attention and heads:
        full_layer += 5 * heads * s * s * b * e / (2 * t)
    stage_layers = -(-layers // (pipeline * stages_per_rank))
    in_flight: tuple[int, ...] | None = (1,)
    if schedule is not None:
        in_flight = schedule_spec(schedule).microbatches_in_flight(pipeline, microbatches, stages_per_rank, 0)
    in_flight = in_flight or (microbatches,) * stages_per_rank
    if checkpointing:
        per_microbatch = stage_layers * s * b * h * e
        recompute = full_layer
    else:
        per_microbatch = stage_layers * full_layer
        recompute = 0
    embeddings = s * b * h * e
    logits = 3 * s * b * vocab * 4 * (microbatches if schedule == "GPipe" else 1)
    if loss_parallel:
        logits = -(-logits // t)
    return int(sum(in_flight) * per_microbatch + in_flight[0] * embeddings + recompute + logits)
