"""The Lightning conformance matrix's pieces, in process: the harness's `compare`
(`tests/support/conformance_harness.py`), the table `python -m benchmarks.conformance` keeps, and the refusals that
name the Trainer flag and what to do (`lightning_dpar.conformance.batchnorm`,
`lightning_dpar.conformance.sampler_check`). The matrix's cells
through real Trainers are in `tests/launched/test_conformance.py` (features in `tests/workers/conformance.py`)."""

from __future__ import annotations

import pytest
import torch

from tests.support.conformance_harness import compare


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

    from lightning_dpar.conformance.batchnorm import check_no_batch_norm_in_pipeline, check_sync_batchnorm_supported
    from lightning_dpar.conformance.sampler_check import check_sampler_shards
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
