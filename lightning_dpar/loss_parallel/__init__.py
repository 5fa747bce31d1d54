"""Loss parallel (`loss_parallel=True`): under tensor parallelism the output layer's logits stay sharded over the
vocabulary and the cross-entropy is computed vocabulary-parallel by torch's `loss_parallel()`; see
docs/efficiency.md.

- `step`: the step of the parallelisation: its slice of the plan (`plan_loss_parallel`, the output layer, with every
  refusal), the output layer's sharded style (`sharded_output_styles`) and the context around each step's forward
  and backward (`around_step`).

`estimate`: the logits' shard in the `plan` dry run; `cost`: the layouts that run it and its collectives in the
layout search.
"""

from lightning_dpar.loss_parallel.step import (
    LossParallelError,
    around_step,
    gathers_columns,
    output_layer_candidate,
    plain_loss,
    plan_loss_parallel,
    sharded_output_styles,
)

__all__ = [
    "LossParallelError",
    "around_step",
    "gathers_columns",
    "output_layer_candidate",
    "plain_loss",
    "plan_loss_parallel",
    "sharded_output_styles",
]
