"""The Lightning conformance matrix's Trainer-flag, buffer and Tuner rows: each feature under every strategy column
either ends as Lightning's DDP does (weights, buffers, logged values) or is refused before any collective. The
table is `docs/lightning-conformance.md`, written by `python -m benchmarks.conformance`. Features:
`tests/workers/conformance.py`; the pieces are tested in process in `tests/unit/conformance/test_conformance.py`."""

from __future__ import annotations

import pytest

from tests.support.conformance_harness import STRATEGY_IDS, ConformanceLaunches, expect_parity, expect_refused
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
