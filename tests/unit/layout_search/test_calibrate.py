"""`calibrate`'s arithmetic: the fit of two timings to the cost model's `steps x latency + bytes / bandwidth`, and
the profile made of launches' measurements (the launches themselves run in the benchmark, not here)."""

from __future__ import annotations

import pytest

from lightning_dpar.layout_search.calibrate import fit_link, profile_from, ring_volume
from lightning_dpar.layout_search.cost import _ring
from lightning_dpar.layout_search.profiles import PRESETS, Link


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"])
@pytest.mark.parametrize("n", [2, 4])
def test_the_fit_recovers_the_link_that_made_the_timings(collective, n):
    link = Link(latency=2e-4, bandwidth=5e8)

    def seconds(nbytes):
        steps, volume = ring_volume(collective, n, nbytes)
        return link.seconds(volume, steps)

    fitted = fit_link(collective, n, (4096, seconds(4096)), (2**23, seconds(2**23)))
    assert fitted.latency == pytest.approx(link.latency)
    assert fitted.bandwidth == pytest.approx(link.bandwidth)


def test_noise_that_makes_the_latency_negative_falls_back_to_the_large_buffers_bandwidth():
    fitted = fit_link("all_gather", 2, (4096, 1e-9), (2**23, 1e-3))
    assert fitted.latency == 0.0
    assert fitted.bandwidth == pytest.approx(2**23 / 2 / 1e-3)


def test_the_cost_model_reads_a_calibrated_collective_back():
    runtime = {"runtime_memory": 5e7, "step_overhead": 0.02}
    rank = {"matmul": {"256": 1e9, "1024": 3e9}, "timings": {"all_reduce": [[4096, 1e-3], [2**23, 2e-2]]}, **runtime}
    slow = {"matmul": {"256": 1e9, "1024": 1e9}, "timings": {"all_reduce": [[4096, 2e-3], [2**23, 4e-2]]}, **runtime}
    launch = {"world_size": 2, "device": "cpu", "ranks": [rank, slow, rank]}
    profile = profile_from([launch], PRESETS["cpu-gloo"], "measured")
    assert profile.matmul_flops == 3e9  # the median rank at the largest size
    link = profile.collectives["all_reduce"]["2"]
    assert link == fit_link("all_reduce", 2, (4096, 2e-3), (2**23, 4e-2))  # the slowest rank
    assert _ring(profile, "all_reduce", 2, 2**23, 2, all_reduce=True) == pytest.approx(4e-2)
    assert profile.devices_per_node == 2 and profile.device_memory > 0
    assert (profile.runtime_memory, profile.step_overhead) == (50_000_000, 0.02)
