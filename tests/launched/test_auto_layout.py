"""`dpar_auto` through real Trainers on 2 and 4 gloo ranks (cases in `tests/workers/auto_layout.py`): the layout it
chooses trains at parity with the same layout chosen by hand and with single-process training."""

from __future__ import annotations

import pytest

ATOL = 1e-5


SHARED_LAUNCH = {2: "auto_layout", 4: "auto_layout"}


@pytest.fixture(scope="module")
def auto2(shared_launch):
    return shared_launch(2)


@pytest.fixture(scope="module")
def auto4(shared_launch):
    return shared_launch(4)


@pytest.mark.slow
@pytest.mark.parametrize("world", ["auto2", "auto4"])
@pytest.mark.parametrize("case", ["auto_gpt", "auto_gpt_budget", "auto_gpt_split"])
def test_auto_trains_at_parity_with_the_same_layout_by_hand(world, case, request):
    result = request.getfixturevalue(world)[case]
    assert result["steps"] == 3
    assert result["auto_vs_hand"] < ATOL
    assert result["auto_vs_single"] < ATOL
    assert result["peak"] <= result["device_memory"]
    assert len(result["runners_up"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("world", ["auto2", "auto4"])
def test_a_memory_budget_below_the_first_choice_changes_the_choice(world, request):
    results = request.getfixturevalue(world)
    assert results["auto_gpt_budget"]["chosen"] != results["auto_gpt"]["chosen"]
    assert results["auto_gpt_budget"]["peak"] < results["auto_gpt"]["peak"]


@pytest.mark.slow
@pytest.mark.parametrize("world", ["auto2", "auto4"])
def test_a_budget_below_every_data_parallel_layout_chooses_pipeline_or_tensor_parallelism(world, request):
    chosen = request.getfixturevalue(world)["auto_gpt_split"]["chosen"]
    assert "pp" in chosen or "tp1" not in chosen, chosen
