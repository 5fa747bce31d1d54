"""Context parallelism as the layout search prices it (`lightning_dpar.layout_search`): the sizes it offers for a
sequence length, the layouts it refuses when their step cannot be traced, and what one step exchanges.

Per layer of the pipeline rank's stages, the sequence's keys and values are all-gathered in forward and their
gradients reduce-scattered in backward (`lightning_dpar.context_parallel.exchange`; the key/value width is taken as
the hidden size, an upper bound under grouped-query attention), and once per step the hidden states are gathered
after the last block and their gradient before the first, all on the critical path. Pure functions of numbers and
mesh sizes; the time of one collective is the caller's `ring(collective, n, nbytes, span)`: seconds of one ring
collective over `n` ranks of an `nbytes` buffer (its whole, unsharded size), its group spanning `span` ranks.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_dpar.helpers import divisors
from lightning_dpar.parallel_dims import ParallelDims

__all__ = ["check_traced", "context_sizes", "exchange_seconds"]


def context_sizes(shard: int, seq_len: int | None, expert: int = 1) -> list[int]:
    """1, and the context-parallel sizes a sequence of `seq_len` tokens can be split over (head-tail: 2 x CP chunks),
    among the divisors of the `shard` ranks CP borrows; only 1 under expert parallelism (`expert > 1`), which CP does
    not compose with yet (both borrow the shard dim's ranks), or when the sequence length is unknown. The blocks see
    `seq_len` tokens of a model that cuts one off its batch (the example GPT) and `seq_len + 1` of one that does not
    (a transformers model given `labels`): either may divide; the dry run's trace, which runs the model's own step,
    refuses the layout if the blocks' length does not."""
    if seq_len is None or expert > 1:
        return [1]
    return [c for c in divisors(shard) if c == 1 or seq_len % (2 * c) == 0 or (seq_len + 1) % (2 * c) == 0]


def check_traced(dims: ParallelDims, why: str) -> None:
    """Refuse a context-parallel layout whose training step the dry run could not trace (`why`: the trace's error, a
    sequence the split cannot cut, say): training would refuse it too. Without CP the activation formula stands in."""
    if dims.context > 1:
        raise ValueError(f"context parallelism: activations {why}")


def exchange_seconds(dims: ParallelDims, layers: int, sequence_bytes: int, ring: Callable[..., float]) -> float:
    """The context-parallel exchanges of one step (see the module docstring); 0 without CP. `layers`: the layers
    of this pipeline rank's stages; `sequence_bytes`: one data-parallel rank's batch of hidden states, whole."""
    if dims.context == 1:
        return 0.0
    whole = sequence_bytes // dims.tensor_parallel
    span = dims.context * dims.tensor_parallel
    keys_values = layers * 2 * (ring("all_gather", dims.context, whole, span))
    keys_values += layers * 2 * ring("reduce_scatter", dims.context, whole, span)
    hidden = 2 * ring("all_gather", dims.context, whole * dims.tensor_parallel, span)
    return keys_values + hidden
