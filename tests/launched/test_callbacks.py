"""`PerformanceMonitor` on 2 gloo ranks (cases in `tests/workers/callbacks.py`): global samples over the data-parallel
ranks, memory gathered from every rank, MFU. What it logs in one process is tested in
`tests/unit/test_performance_monitor.py`."""

from __future__ import annotations

import pytest

from tests.workers.callbacks import SLOW_RANK, SLOW_S

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


@pytest.mark.slow
def test_a_rank_slowed_in_its_step_is_named_with_its_host(monitored):
    """Rank 1 sleeps 0.3 s in each of 8 steps on CPU: after 3 log intervals in a row above the median by over 50%, one
    warning names it and its host; the spread across ranks shows it as the slowest."""
    result = monitored["monitor_straggler"]
    print(f"straggler report: {result['stragglers']}; last interval: {result['spread']}")
    (report,) = result["stragglers"]
    assert report["rank"] == SLOW_RANK and report["own_time_s"] > SLOW_S, report
    (warning,) = result["warnings"]
    assert f"rank {SLOW_RANK} on host {report['host']!r}" in warning, warning
    spread = result["spread"]
    assert spread["perf/slowest_rank"] == SLOW_RANK and spread["perf/own_time_max_s"] > SLOW_S, spread
    # Every rank's wall step time is about the same: the others wait for it in the gradient all-reduce.
    assert spread["perf/step_time_min_s"] > SLOW_S, spread
