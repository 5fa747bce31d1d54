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

from lightning_dpar.activation_checkpointing.estimate import checkpointed_layers
from lightning_dpar.loss_parallel.estimate import logit_bytes
from lightning_dpar.pipeline.estimate import microbatches_in_flight, outputs_in_flight, stage_share
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
    spec = schedule_spec(schedule) if schedule is not None else None
    in_flight, _ = microbatches_in_flight(spec, pipeline, microbatches, stages_per_rank, 0)
    layer_input = s * b * h * e
    kept, recompute = checkpointed_layers(
        checkpointing, stage_share(layers, pipeline, stages_per_rank), layer_input, full_layer
    )
    logits = logit_bytes(3 * s * b * vocab * 4 * outputs_in_flight(schedule, microbatches), t, loss_parallel)
    return int(sum(in_flight) * kept + in_flight[0] * layer_input + recompute + logits)
