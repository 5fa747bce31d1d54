"""Loss parallelism as the layout search prices it (`lightning_dpar.layout_search`): which layouts run it, the
output features a plan gathers whole, and what the output layer communicates with and without loss parallel.

With tensor parallelism, the output layer's logits are either gathered whole on every tensor-parallel rank once per
microbatch (the plan's column-wise style with its output gathered; the backward only slices), or, under loss
parallel, stay sharded over the vocabulary, and torch's `loss_parallel()` computes the cross entropy with three
all-reduces of one float per token instead (the row maximum, the sum of exponentials, the target's logit). Pure
functions of numbers and mesh sizes; the time of one collective is the caller's `ring(collective, n, nbytes, span,
all_reduce)`: seconds of one ring collective over `n` ranks of an `nbytes` buffer, its group spanning `span` ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_dpar.loss_parallel.step import gathers_columns, layout_refusal
from lightning_dpar.parallel_dims import ParallelDims

__all__ = ["gathered_output_features", "output_layer_seconds", "runs_loss_parallel"]


def runs_loss_parallel(allowed: bool, dims: ParallelDims) -> bool:
    """Whether a layout of `dims` runs loss parallel when the user `allowed` it: with tensor parallelism, and
    without pipeline or context parallelism (the step's `layout_refusal`). It is not a choice: with tensor
    parallelism it only saves memory and communication."""
    return allowed and layout_refusal(dims, "loss_parallel=True") is None


def gathered_output_features(module: nn.Module, styles: Mapping[str, ParallelStyle]) -> int:
    """The output features of the `nn.Linear` layers of `module` whose column-wise output the tensor-parallel
    `styles` (`{fqn: style}`, a plan's) gather whole on every tensor-parallel rank (`gathers_columns`): the output
    layer, in a language model, whose logits loss parallel would keep sharded instead."""
    return sum(
        module.get_submodule(fqn).out_features
        for fqn, style in styles.items()
        if gathers_columns(style) and isinstance(module.get_submodule(fqn), nn.Linear)
    )


def output_layer_seconds(
    loss_parallel: bool,
    tensor_parallel: int,
    microbatches: int,
    tokens: int,
    gathered_output: int,
    element_size: int,
    ring: Callable[..., float],
) -> float:
    """The output layer's communication of one step (see the module docstring): `tokens` per microbatch,
    `gathered_output` the output features the plan gathers whole (0: none), `element_size` the logits' bytes."""
    if loss_parallel:
        return microbatches * 3 * ring("all_reduce", tensor_parallel, tokens * 4, tensor_parallel, True)
    if gathered_output:
        logits = tokens * gathered_output * element_size
        return microbatches * ring("all_gather", tensor_parallel, logits, tensor_parallel)
    return 0.0
