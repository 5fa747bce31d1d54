"""The conformance matrix's callback rows: each of Lightning's built-in callbacks under every strategy column ends
as under Lightning's DDP (weights, the callback's own state, logged values), or is refused before any collective.
Features: `tests/workers/conformance_callbacks.py`; harness: `tests/support/conformance_harness.py`; behaviour:
`docs/callbacks.md`.

The pieces are tested in-process: the averaged copy laid out like a sharded model in
`tests/unit/conformance/test_weight_averaging.py`, model-shaped checkpoint entries split off to DCP and found again on
load in `tests/unit/checkpoint/test_model_shaped.py`, the refusals in `tests/unit/conformance/test_callback_checks.py`.
"""

from __future__ import annotations

import pytest

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
