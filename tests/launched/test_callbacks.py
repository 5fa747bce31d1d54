"""`PerformanceMonitor` on 2 gloo ranks (cases in `tests/workers/callbacks.py`): global samples over the data-parallel
ranks, memory gathered from every rank, MFU. What it logs in one process is tested in
`tests/unit/test_performance_monitor.py`."""

from __future__ import annotations

import pytest

SHARED_LAUNCH = {2: "monitor"}


@pytest.fixture(scope="module")
def monitored(shared_launch):
    return shared_launch(2)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "2d"])
def test_counts_global_samples_over_data_parallel_ranks_and_gathers_memory(monitored, strategy):
    result = monitored[f"monitor_{strategy}"]
    assert result["samples_per_record"] == [4.0 * result["dp"]] * 4
    assert len(result["peak_memory_per_rank"]) == 2 and min(result["peak_memory_per_rank"]) > 50 * 1024**2
    assert "rank 1 peak RSS" in result["summary"]
    metrics = result["metrics"]
    assert metrics["perf/samples_per_s"] == pytest.approx(4.0 * result["dp"] / metrics["perf/step_time_s"])
    # MFU: this rank's share of 6 * N * tokens (a tensor-parallel group shares one batch) per second, over the peak.
    rank_flops = 6 * result["parameter_count"] * result["rank_batch"] * 3 / result["tp"]
    assert metrics["perf/mfu"] == pytest.approx(rank_flops / metrics["perf/step_time_s"] / 1e12)
