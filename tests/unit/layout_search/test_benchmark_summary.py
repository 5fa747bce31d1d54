"""`benchmarks/layout_search.py`'s comparison arithmetic: Spearman's rank correlation, the chosen layout against the
measured best, and the memory error, on known numbers."""

from __future__ import annotations

import pytest

from benchmarks.layout_search import spearman, summarize


def test_spearman_on_known_orders():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(0.8660254)  # ties get their average rank


def row(layout, fits, samples, pred, meas, pred_peak, peak, runtime=10):
    """A measured layout whose RSS is its tensors plus the profile's `runtime` exactly."""
    return {
        "layout": layout,
        "fits": fits,
        "samples": samples,
        "pred_step_s": pred,
        "step_s": meas,
        "pred_peak_bytes": pred_peak + runtime,
        "pred_runtime_bytes": runtime,
        "peak_bytes": peak + runtime,
        "tensor_peak_bytes": peak,
    }


def test_summary_compares_per_sample_and_takes_the_first_fitting_layout_as_the_choice():
    rows = [
        row("a", True, 32, 1.0, 2.0, 100, 100),  # chosen: 62.5 ms per sample
        row("b", True, 16, 0.6, 0.8, 100, 50),  # measured best: 50 ms per sample
        row("c", False, 32, 3.0, 4.0, 300, 400),
        {"layout": "d", "fits": True, "samples": 32, "pred_step_s": 1.0, "pred_peak_bytes": 1, "error": "boom"},
    ]
    summary = summarize(rows)
    assert summary["layouts_run"] == 3 and summary["layouts_failed"] == 1
    assert summary["chosen"] == "a" and summary["measured_best"] == "b"
    assert summary["chosen_over_best"] == pytest.approx(1.25)
    # Tensors: predicted 100, 100, 300 against measured 100, 50, 400 (the runtime left out of both).
    assert summary["memory_error_median"] == pytest.approx(0.25)
    assert summary["memory_error_max"] == pytest.approx(1.0)
    assert summary["memory_within_25pct"] == 2
    # RSS: 110, 110, 310 against 110, 60, 410.
    assert summary["rss_error_median"] == pytest.approx(100 / 410)
    assert summary["rss_error_max"] == pytest.approx(50 / 60)
    assert summary["spearman_time_per_sample"] == pytest.approx(0.5)
