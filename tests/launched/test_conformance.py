"""The Lightning conformance matrix's Trainer-flag, buffer and Tuner rows: each feature under every strategy column
either ends as Lightning's DDP does (weights, buffers, logged values) or is refused before any collective. The
table is `docs/lightning-conformance.md`, written by `python -m benchmarks.conformance`."""

from __future__ import annotations

import pytest
import torch

from tests.support.conformance_harness import STRATEGY_IDS, ConformanceLaunches, compare, expect_parity, expect_refused
from tests.workers.conformance import FEATURES


@pytest.fixture(scope="session")
def conformance(request, tmp_path_factory) -> ConformanceLaunches:
    return ConformanceLaunches("conformance", __name__, request, tmp_path_factory)


SYNC_BN = r"ValueError: `Trainer\(sync_batchnorm=True\)` converts \['model.norm'\] to `torch.nn.SyncBatchNorm`"
REFUSED: dict[tuple[str, str], str] = {
    **{("sync_batchnorm", s): SYNC_BN for s in STRATEGY_IDS},
    ("buffers", "pipeline"): r"has BatchNorm layers \['model.norm'\], and `pipeline_parallel_size=2`",
    ("detect_anomaly", "dpar_2d"): r"`Trainer\(detect_anomaly=True\)` cannot run with `tensor_parallel_size=2`",
    ("manual_optimization", "pipeline"): r"sets `automatic_optimization = False`, and `pipeline_parallel_size=2`",
    **{
        ("use_distributed_sampler_false_world_sampler", s): r"`DistributedSampler` splits the data into 4 shards, but"
        r" only 2 of the 4 ranks"
        for s in ("dpar_2d",)
    },
    ("use_distributed_sampler_false_world_sampler", "pipeline"): r"splits the data into 2 shards, but only 1 of the 2",
    **{
        ("scale_batch_size", s): "Tuning the batch size is currently not supported with distributed strategies"
        for s in STRATEGY_IDS
    },
}

#: Every cell is a multi-process launch, so all are in the slow lane (the full suite, which CI runs, has them all;
#: the fast lane must stay under 2 minutes). The whole matrix alone: `python -m benchmarks.conformance`.
CELLS = [
    pytest.param(
        feature,
        strategy,
        id=f"{feature}-{strategy}",
        marks=[pytest.mark.conformance(feature), pytest.mark.slow],
    )
    for feature in FEATURES
    for strategy in STRATEGY_IDS
]


@pytest.mark.parametrize(("feature", "strategy"), CELLS)
def test_cell(conformance, feature, strategy, request):
    """The feature under the strategy ends as under Lightning's DDP, or is refused on every rank with the message
    `REFUSED` gives (before any collective: the refusals are raised in `setup_environment` or on the loader)."""
    cell = conformance.cell(feature, strategy)
    refusal = REFUSED.get((feature, strategy))
    if refusal is not None:
        expect_refused(request, cell, refusal)
    else:
        expect_parity(request, cell)


# ---------------------------------------------------------------------------------------------------- the pieces
def test_compare_reports_each_difference_beyond_atol():
    want = {"state": {"w": [1.0, 2.0]}, "logged": {"loss": 0.5}, "left_behind": []}
    assert compare({"state": {"w": [1.0, 2.0 + 5e-6]}, "logged": {"loss": 0.5}, "left_behind": []}, want) == []
    problems = compare({"state": {"w": [1.0, 2.1]}, "logged": {}, "left_behind": [".lr_find_x.ckpt"]}, want)
    assert problems == [
        ".state.w[1]: got 2.1, want 2.0 (difference 0.1 > atol 1e-05)",
        ".logged.loss: missing",
        '.left_behind: got [".lr_find_x.ckpt"], want []',
    ]


def test_matrix_table_keeps_the_cells_a_partial_run_did_not_touch():
    from benchmarks.conformance import START, Collector, read_table, update_doc

    first = Collector()
    for strategy, outcome in (("dpar_fsdp", "parity"), ("pipeline", "refused")):
        first.add("buffers", strategy, outcome)
    text = update_doc("# Title\n", first, ["dpar_fsdp", "pipeline"], "Last run: one.")
    assert text.startswith("# Title\n") and START in text
    second = Collector()
    second.add("lr_find", "dpar_fsdp", "parity")
    second.add("lr_find", "dpar_fsdp", "failed")  # two tests of one cell: the worst outcome counts
    rows, columns, cells = read_table(update_doc(text, second, ["dpar_fsdp", "pipeline"], "Last run: two."))
    assert rows == ["buffers", "lr_find"] and columns == ["dpar_fsdp", "pipeline"]
    assert cells == {
        ("buffers", "dpar_fsdp"): "parity",
        ("buffers", "pipeline"): "refused",
        ("lr_find", "dpar_fsdp"): "failed",
    }


def test_refusals_name_the_flag_and_what_to_do():
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_dpar.batchnorm import check_no_batch_norm_in_pipeline, check_sync_batchnorm_supported
    from lightning_dpar.sampling import check_sampler_shards
    from tests.support.models import RegressionData

    with_norm = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with pytest.raises(
        ValueError, match=r"sync_batchnorm=True\)` converts \['1'\].*not on 'cpu'.*sync_batchnorm=False"
    ):
        check_sync_batchnorm_supported(with_norm, torch.device("cpu"))
    check_sync_batchnorm_supported(nn.Linear(2, 2), torch.device("cpu"))  # nothing to convert: as under DDP
    with pytest.raises(ValueError, match=r"BatchNorm layers \['1'\].*`pipeline_parallel_size=2`.*nn.LayerNorm"):
        check_no_batch_norm_in_pipeline(with_norm, 2)
    data = RegressionData(16)
    world = DataLoader(data, sampler=DistributedSampler(data, num_replicas=4, rank=1))
    with pytest.raises(
        ValueError, match=r"splits the data into 4 shards, but only 2 of the 4 ranks.*distributed_sampler"
    ):
        check_sampler_shards(world, num_replicas=2, world_size=4)
    check_sampler_shards(DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=1)), 2, 4)
