"""The Lightning conformance matrix's Trainer-flag, buffer and Tuner rows: each feature under every strategy column
either ends as Lightning's DDP does (weights, buffers, logged values) or is refused before any collective. The
table is `docs/lightning-conformance.md`, written by `python -m benchmarks.conformance`."""

from __future__ import annotations

import pytest

from tests.conformance_harness import STRATEGY_IDS, ConformanceLaunches, expect_parity


@pytest.fixture(scope="session")
def conformance(request, tmp_path_factory) -> ConformanceLaunches:
    return ConformanceLaunches("conformance", __name__, request, tmp_path_factory)


@pytest.mark.conformance("buffers")
@pytest.mark.parametrize("strategy", STRATEGY_IDS)
def test_buffers_kept_as_ddp_keeps_them(conformance, strategy, request):
    """DDP broadcasts rank 0's buffers before each forward that follows a training forward: every rank evaluates
    with the same statistics and differs from rank 0 only by its last step's update."""
    expect_parity(request, conformance.cell("buffers", strategy))
