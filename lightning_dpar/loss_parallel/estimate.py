"""What loss parallel does to a step's activation memory, for `lightning_dpar.estimates` (the `plan` dry run's
traced step, and the activation formula a layout search falls back on): each tensor-parallel rank keeps only its
vocabulary shard of the logits, of the log-probabilities the loss keeps and of their gradient; how a trace runs
torch's vocabulary-parallel cross-entropy's backward; and the report's line about it.

Pure: the estimates pass numbers, and the traced op with a way to read a tensor's split flag, in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_dpar._private_api import log_softmax_backward_op

__all__ = ["describe_sharded_logits", "logit_bytes", "vocabulary_parallel_gradient"]


def logit_bytes(logits: int, tensor_parallel: int, loss_parallel: bool) -> int:
    """One rank's share of `logits` bytes of whole logits (and what the loss keeps of them): all of them, or under
    loss parallel their vocabulary shard, rounded up."""
    return -(-logits // tensor_parallel) if loss_parallel else logits


def vocabulary_parallel_gradient(
    func: Any, args: Sequence[Any], is_split: Callable[[torch.Tensor], bool]
) -> torch.Tensor | None:
    """The output a trace gives the log-softmax's backward on split (vocabulary-sharded) logits under loss parallel,
    `None` for any other op: torch's `loss_parallel()` computes the whole cross-entropy gradient in the loss's
    backward and hands it through the log-softmax's as it is (`grad_output.to(dtype)`), making no second shard."""
    if func is not log_softmax_backward_op() or not is_split(args[0]):
        return None
    return args[0].to(args[3])


def describe_sharded_logits(output_layer: str) -> str:
    """The report's line on the output layer whose logits loss parallel keeps sharded."""
    return f"  loss parallel: the logits of {output_layer} kept sharded over the vocabulary"
