"""Context parallelism's pricing for the layout search: the sizes offered for a sequence length, and one step's
exchanges of keys, values and hidden states."""

from __future__ import annotations

import pytest

from lightning_dpar.context_parallel.cost import check_traced, context_sizes, exchange_seconds
from lightning_dpar.parallel_dims import ParallelDims


def test_the_sizes_whose_head_tail_chunks_split_the_sequence():
    assert context_sizes(8, 512) == [1, 2, 4, 8]
    assert context_sizes(8, 12) == [1, 2]  # 12 tokens cut into 4 chunks, not 8 or 16
    assert context_sizes(8, 11) == [1, 2]  # 11 + 1 tokens: a model given `labels` sees one more
    assert context_sizes(8, None) == [1]  # unknown sequence length
    assert context_sizes(8, 512, expert=2) == [1]  # not with expert parallelism yet


def test_each_layer_gathers_keys_and_values_and_scatters_their_gradients_and_the_step_gathers_the_hidden_states():
    calls = []

    def ring(collective: str, n: int, nbytes: float, span: int) -> float:
        calls.append((collective, n, nbytes, span))
        return 1.0

    dims = ParallelDims(world_size=8, replicate=1, shard=4, tensor_parallel=2, context=2)
    assert exchange_seconds(dims, layers=3, sequence_bytes=1000, ring=ring) == 3 * 2 + 3 * 2 + 2
    assert calls == [("all_gather", 2, 500, 4), ("reduce_scatter", 2, 500, 4), ("all_gather", 2, 1000, 4)]
    assert exchange_seconds(ParallelDims(world_size=4, replicate=1, shard=4, tensor_parallel=1), 3, 1000, ring) == 0


def test_a_context_parallel_layout_whose_step_cannot_be_traced_is_refused_with_the_traces_error():
    with pytest.raises(ValueError, match=r"^context parallelism: activations cannot cut 10 tokens$"):
        check_traced(
            ParallelDims(world_size=4, replicate=1, shard=4, tensor_parallel=1, context=2), "cannot cut 10 tokens"
        )
    check_traced(
        ParallelDims(world_size=4, replicate=1, shard=4, tensor_parallel=1), "no trace"
    )  # the formula stands in
