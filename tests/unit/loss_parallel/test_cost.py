"""Loss parallelism's pricing for the layout search: the layouts that run it, and what the output layer
communicates with it (three all-reduces of a float per token) and without (its logits gathered whole)."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_dpar.loss_parallel.cost import gathered_output_features, output_layer_seconds, runs_loss_parallel
from lightning_dpar.parallel_dims import ParallelDims


def test_loss_parallel_runs_where_allowed_with_tensor_parallelism_but_no_pipeline_or_context_parallelism():
    def dims(tp: int = 2, pp: int = 1, cp: int = 1) -> ParallelDims:
        return ParallelDims(world_size=4 * pp, replicate=1, shard=4 // tp, tensor_parallel=tp, pipeline=pp, context=cp)

    assert runs_loss_parallel(True, dims())
    assert not runs_loss_parallel(False, dims())
    assert not runs_loss_parallel(True, dims(tp=1))
    assert not runs_loss_parallel(True, dims(pp=2))
    assert not runs_loss_parallel(True, dims(cp=2))


def test_sharded_logits_all_reduce_three_floats_per_token_and_gathered_ones_move_the_whole_logits():
    calls = []

    def ring(collective: str, n: int, nbytes: float, span: int, all_reduce: bool = False) -> float:
        calls.append((collective, n, nbytes, span, all_reduce))
        return 1.0

    assert (
        output_layer_seconds(True, 2, microbatches=4, tokens=10, gathered_output=100, element_size=2, ring=ring) == 12
    )
    assert calls == [("all_reduce", 2, 40, 2, True)]
    calls.clear()
    assert output_layer_seconds(False, 2, 4, 10, 100, 2, ring) == 4
    assert calls == [("all_gather", 2, 10 * 100 * 2, 2, False)]
    assert output_layer_seconds(False, 2, 4, 10, 0, 2, ring) == 0.0  # nothing gathered whole


def test_the_output_features_gathered_whole_are_the_column_wise_linears_with_a_replicated_output():
    model = nn.ModuleDict({"fc": nn.Linear(8, 16), "proj": nn.Linear(16, 8), "head": nn.Linear(8, 100)})
    gathered = ColwiseParallel(output_layouts=Replicate())
    styles = {"fc": ColwiseParallel(), "proj": RowwiseParallel(), "head": gathered}
    assert gathered_output_features(model, styles) == 100
    assert gathered_output_features(model, {"fc": ColwiseParallel()}) == 0
