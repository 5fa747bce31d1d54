"""The conformance matrix's callback rows: each of Lightning's built-in callbacks under every strategy column ends
as under Lightning's DDP (weights, the callback's own state, logged values), or is refused before any collective.
Features: `tests/workers/conformance_callbacks.py`; harness: `tests/support/conformance_harness.py`; behaviour:
`docs/callbacks.md`.

The fast lane checks the pieces in-process: the averaged copy laid out like a sharded model, and model-shaped
checkpoint entries split off to DCP and found again on load.
"""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, ModelPruning
from torch import nn

from lightning_dpar.callback_checks import refuse_unsupported_callbacks
from lightning_dpar.checkpoint.model_shaped import SHARDED_ENTRY, marked_entries
from lightning_dpar.checkpoint.sharded import split_checkpoint
from lightning_dpar.weight_averaging import lay_out_like
from tests.support.conformance_harness import STRATEGY_IDS, ConformanceLaunches, expect_parity, expect_refused


@pytest.fixture(scope="session")
def callbacks_matrix(request, tmp_path_factory) -> ConformanceLaunches:
    return ConformanceLaunches("callbacks", __name__, request, tmp_path_factory)


# ---------------------------------------------------------------------------------------------------- the matrix
@pytest.mark.slow
@pytest.mark.conformance("ema")
@pytest.mark.parametrize("strategy", STRATEGY_IDS)
def test_ema_weight_averaging(callbacks_matrix, strategy, request):
    """Failed before the fix under every sharded column: `aten.copy_.default got mixed torch.Tensor and DTensor`."""
    cell = callbacks_matrix.cell("ema", strategy)
    expect_parity(request, cell)
    assert cell.value["laid_out_like_model"]  # the averaged weights are shards with the parameters' placements


@pytest.mark.slow
@pytest.mark.conformance("ema_resume")
@pytest.mark.parametrize("strategy", STRATEGY_IDS)
def test_ema_weight_averaging_resumes_exactly(callbacks_matrix, strategy, request):
    cell = callbacks_matrix.cell("ema_resume", strategy)
    expect_parity(request, cell)
    assert cell.value["resume_gap"] == 0.0


@pytest.mark.slow
@pytest.mark.conformance("ema_resume_full")
@pytest.mark.parametrize("strategy", ["dpar_fsdp"])
def test_ema_weight_averaging_resumes_exactly_from_a_full_checkpoint(callbacks_matrix, strategy, request):
    """`checkpoint_format="full"`: the averaged weights are gathered into the file and laid out as shards on load."""
    cell = callbacks_matrix.cell("ema_resume_full", strategy)
    expect_parity(request, cell)
    assert cell.value["resume_gap"] == 0.0


@pytest.mark.slow
@pytest.mark.conformance("swa")
@pytest.mark.parametrize("strategy", STRATEGY_IDS)
def test_stochastic_weight_averaging(callbacks_matrix, strategy, request):
    """Failed before the fix under every sharded column (mixed torch.Tensor and DTensor)."""
    expect_parity(request, callbacks_matrix.cell("swa", strategy))


@pytest.mark.slow
@pytest.mark.conformance("swa_resume")
@pytest.mark.parametrize("strategy", STRATEGY_IDS)
def test_stochastic_weight_averaging_resumes_exactly(callbacks_matrix, strategy, request):
    cell = callbacks_matrix.cell("swa_resume", strategy)
    expect_parity(request, cell)
    assert cell.value["resume_gap"] == 0.0


@pytest.mark.slow
@pytest.mark.conformance("backbone_finetuning")
@pytest.mark.parametrize("strategy", STRATEGY_IDS)
def test_backbone_finetuning(callbacks_matrix, strategy, request):
    """Compared with one process on the same global batches (the feature's reference run), since Lightning's DDP
    drifts here: it never all-reduces parameters that were frozen when it wrapped the model. Failed before the fix
    under `dpar_fsdp`: `aten.equal.default got mixed torch.Tensor and DTensor` (the frozen backbone, an FSDP root
    no backward reshards, stayed unsharded), and under `dpar_replicate`: DDP refused the all-frozen backbone."""
    cell = callbacks_matrix.cell("backbone_finetuning", strategy)
    if strategy == "pipeline":  # the frozen backbone fills stage 0, whose optimizer would have no parameters
        expect_refused(request, cell, match=r"BackboneFinetuning froze them before training", error_type="ValueError")
        return
    if strategy == "dpar_2d":  # Lightning compares parameters by value, across the TP and data-parallel meshes
        expect_refused(
            request, cell, match=r"BackboneFinetuning cannot unfreeze .* by identity", error_type="ValueError"
        )
        return
    expect_parity(request, cell, keys=("state", "rank_spread"))
    if cell.column.data_parallel > 1:  # what the one-process reference avoids: DDP's ranks drift apart
        assert cell.reference_value["ddp_rank_spread"] > 1e-3


@pytest.mark.slow
@pytest.mark.conformance("gradient_accumulation_scheduler")
@pytest.mark.parametrize("strategy", STRATEGY_IDS)
def test_gradient_accumulation_scheduler(callbacks_matrix, strategy, request):
    expect_parity(request, callbacks_matrix.cell("gradient_accumulation_scheduler", strategy))


@pytest.mark.slow
@pytest.mark.conformance("lr_monitor")
@pytest.mark.parametrize("strategy", STRATEGY_IDS)
def test_learning_rate_monitor(callbacks_matrix, strategy, request):
    expect_parity(request, callbacks_matrix.cell("lr_monitor", strategy))


@pytest.mark.slow
@pytest.mark.conformance("early_stopping")
@pytest.mark.parametrize("strategy", STRATEGY_IDS)
def test_early_stopping(callbacks_matrix, strategy, request):
    cell = callbacks_matrix.cell("early_stopping", strategy)
    expect_parity(request, cell)
    assert cell.value["stopped_epoch"] == 1  # it did stop early (max_epochs=5)


@pytest.mark.slow
@pytest.mark.conformance("model_pruning")
@pytest.mark.parametrize("strategy", STRATEGY_IDS)
def test_model_pruning(callbacks_matrix, strategy, request):
    """Before the refusal, `dpar_fsdp` failed at the first epoch's end (global pruning cannot flatten a shard)."""
    cell = callbacks_matrix.cell("model_pruning", strategy)
    if strategy == "dpar_replicate":
        expect_parity(request, cell)
    else:
        expect_refused(
            request, cell, match=r"ModelPruning cannot prune under .*'dpar_replicate'", error_type="ValueError"
        )


# ---------------------------------------------------------------------------------------------------- in-process
class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.second.weight = self.first.weight
        self.norm = nn.BatchNorm1d(4)


def test_averaged_copy_is_laid_out_like_a_sharded_model(fake_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    fake_world(2)
    torch.manual_seed(0)
    model = Tied()
    average = copy.deepcopy(model)  # what the callbacks take in `setup`, before the strategy parallelises
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    lay_out_like(average, model, "EMAWeightAveraging")
    for (name, ours), (_, theirs) in zip(average.named_parameters(), model.named_parameters()):
        assert isinstance(ours, DTensor), name
        assert (ours.device_mesh, ours.placements, ours.shape) == (theirs.device_mesh, theirs.placements, theirs.shape)
        assert torch.equal(ours.to_local(), theirs.to_local()) and ours is not theirs and not ours.requires_grad
    assert average.second.weight is average.first.weight  # still tied
    assert [n for n, _ in average.named_buffers()] == [n for n, _ in model.named_buffers()]
    averaged = dict(average.named_parameters())
    lay_out_like(average, model, "EMAWeightAveraging")  # a second `setup`: the averages are kept
    assert all(p is averaged[n] for n, p in average.named_parameters())


def test_averaged_copy_drops_what_another_pipeline_stage_holds():
    model = Tied()
    average = copy.deepcopy(model)
    model.norm = nn.Identity()  # held by another stage: the stage has no such parameters
    lay_out_like(average, model, "StochasticWeightAveraging")
    assert [n for n, _ in average.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert [n for n, _ in average.named_buffers()] == []


def test_model_shaped_checkpoint_entries_go_to_dcp_and_are_found_again():
    weights = {"a.weight": torch.ones(2), "a.bias": torch.zeros(1)}
    checkpoint = {
        "state_dict": weights,
        "current_model_state": dict(weights),  # WeightAveraging's set-aside training weights
        "averaging_state": {"n_averaged": torch.tensor(3)},  # not keyed like the model: stays in meta.pt
        "callbacks": {"StochasticWeightAveraging{'swa_lrs': 0.1}": {"average_model_state": dict(weights), "n": 1}},
        "optimizer_states": [],
    }
    tensor_state, metadata = split_checkpoint(checkpoint)
    assert set(tensor_state) == {"state_dict", "current_model_state", "callback_state_0"}
    assert metadata["current_model_state"] == {SHARDED_ENTRY: "current_model_state"}
    assert metadata["averaging_state"]["n_averaged"].item() == 3
    swa_state = metadata["callbacks"]["StochasticWeightAveraging{'swa_lrs': 0.1}"]
    assert swa_state == {"average_model_state": {SHARDED_ENTRY: "callback_state_0"}, "n": 1}
    assert "average_model_state" in next(iter(checkpoint["callbacks"].values()))  # the callback's dict untouched
    assert sorted(key for _, _, key in marked_entries(metadata)) == ["callback_state_0", "current_model_state"]


@pytest.mark.parametrize("whole_parameters", [True, False])
def test_model_pruning_refused_where_parameters_are_shards(whole_parameters):
    callbacks = [ModelPruning("l1_unstructured", amount=0.3)]
    if whole_parameters:
        refuse_unsupported_callbacks(callbacks, "ReplicateStrategy", whole_parameters=True, tensor_parallel=1)
    else:
        with pytest.raises(ValueError, match=r"ModelPruning cannot prune under FullyShardStrategy.*dpar_replicate"):
            refuse_unsupported_callbacks(callbacks, "FullyShardStrategy", whole_parameters=False, tensor_parallel=1)


class IdentityFinetuning(BackboneFinetuning):
    @staticmethod
    def filter_on_optimizer(optimizer, params):
        return [p for p in params if not any(p is q for group in optimizer.param_groups for q in group["params"])]


@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_finetuning_refused_with_tensor_parallelism(tensor_parallel):
    callbacks = [BackboneFinetuning()]
    refuse_unsupported_callbacks([IdentityFinetuning()], "FSDPTensorParallelStrategy", False, tensor_parallel=2)
    if tensor_parallel == 1:
        refuse_unsupported_callbacks(callbacks, "FullyShardStrategy", whole_parameters=False, tensor_parallel=1)
    else:
        with pytest.raises(ValueError, match=r"BackboneFinetuning cannot unfreeze .*tensor_parallel_size=2.*identity"):
            refuse_unsupported_callbacks(
                callbacks, "FSDPTensorParallelStrategy", whole_parameters=False, tensor_parallel=2
            )
