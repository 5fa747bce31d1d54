"""Training behaviour beyond parity through real Trainers on 2 and 4 gloo ranks: reductions over the data-parallel
group, ignored modules, plan sources, evaluation after fit, meta-device init and gradient accumulation (cases in
`tests/workers/features.py`; launches: the `world*` fixtures of `tests/conftest.py`)."""

from __future__ import annotations

import pytest

from tests.conftest import WORLD_GROUPS
from tests.launched.test_parity import ATOL

SHARED_LAUNCH = WORLD_GROUPS  # through the session fixtures `world4`, `world2`, `world1`


@pytest.mark.slow
@pytest.mark.parametrize("world", ["world2", "world4"])
def test_logging_and_metrics_reduce_over_data_parallel_group_only(world, request):
    """TP peers hold identical values: counting them would double the sums on a (dp, tp=2) mesh."""
    sync = request.getfixturevalue(world)["sync"]
    dp, steps = sync["dp"], sync["steps"]
    assert sync["logged_dp_rank_sum"] == sum(range(dp))
    assert sync["reduce_sum_of_ones"] == dp
    # SumMetric fed dp_rank + 1 each step, synced over its process group.
    assert sync["metric_total"] == steps * dp * (dp + 1) / 2


@pytest.mark.slow
def test_ignored_modules_are_not_synchronised(world4):
    ignored = world4["ignored"]
    assert ignored["synced_max_diff_across_ranks"] == 0.0
    assert ignored["ignored_max_diff_across_ranks"] > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        "plan_from_attribute",
        "plan_from_configure_model",
        "tp_only_configure_model",
        "registered_name_auto_sizes",
        "2d_hsdp",
    ],
)
def test_plan_sources(world4, case):
    """The TP plan may come from the LightningModule or its own ModelParallelStrategy-style configure_model."""
    assert world4[case]["max_abs_diff"] < ATOL


@pytest.mark.slow
def test_fit_then_validate_test_predict(world4):
    result = world4["fit_then_eval"]
    assert result["units_after_fit"] == result["units_after_eval"] > 0  # parallelism applied once
    assert result["val_loss_diff"] < ATOL
    assert result["test_loss_diff"] < ATOL
    assert result["predict_max_diff"] < ATOL


@pytest.mark.slow
@pytest.mark.parametrize("case", ["meta_configure_model", "meta_init_module"])
def test_meta_device_init_materialises_shards_only(world4, case):
    report = world4[case]
    assert report["built_on_meta"]
    assert not report["any_meta"]
    assert report["largest_local_fraction"] < 1.0  # every parameter is a strict shard of the full tensor
    assert report["all_finite"] and report["train_loss_finite"]


@pytest.mark.slow
@pytest.mark.parametrize("world", ["world2", "world4"])
def test_accumulation_skips_gradient_sync_on_non_final_micro_batches(world, request):
    result = request.getfixturevalue(world)["accumulate_no_sync"]
    # FSDP2 only produces sharded gradients when it reduce-scatters: never after the first of two micro-batches.
    assert result["fsdp_grads_after_each_backward"] == [False, True] * result["steps"]
    # DDP's comm hook runs once per optimizer step (one bucket), not once per micro-batch.
    assert result["replicate_hook_calls"] == result["steps"]
