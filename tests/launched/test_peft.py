"""peft LoRA training equals single-process LoRA training on 2 and 4 gloo ranks (slow; cases in
`tests/workers/peft.py`). The in-process plan tests (meta models) are in `tests/unit/plan/test_adapters.py`.
Skipped without peft."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")


ATOL = 1e-5


# ------------------------------------------------------------------ parity on 2 and 4 gloo ranks
PARITY = [
    "lora_fsdp",
    "lora_replicate",
    "lora_2d_auto_qv",
    "lora_2d_auto_all_linear",
    "lora_2d_base_names_plan",
    "lora_pipeline",
    "lora_tied_2d_auto",
]


SHARED_LAUNCH = {2: "peft", 4: "peft"}


@pytest.fixture(scope="module")
def world2(shared_launch):
    return shared_launch(2)


@pytest.fixture(scope="module")
def world4(shared_launch):
    return shared_launch(4)


def check_parity(result: dict) -> None:
    assert result["trainable_moved"] > 1e-3  # the adapters trained: the comparison is not of untouched weights
    assert result["trainable_max_abs_diff"] < ATOL
    assert result["frozen_max_abs_diff"] == 0.0  # the base never moves
    if "loss_max_abs_diff" in result:
        assert result["loss_max_abs_diff"] < ATOL
    for rank, held in enumerate(result["held_per_rank"]):
        assert held["frozen_with_grad"] == [] and held["frozen_with_state"] == 0, rank
        assert held["trainable_with_state"] == held["trainable_local"] > 0, rank
    for rank, held in enumerate(result["monitor_held"]):  # the PerformanceMonitor's per-rank measurement
        assert held["gradients"] == held["trainable"] == held["optimizer"] > 0, rank
        assert held["frozen"] > held["trainable"], rank  # the tiny base is only 4x its adapters (all-linear, r=4)


@pytest.mark.slow
@pytest.mark.parametrize("world", ["world2", "world4"])
@pytest.mark.parametrize("case", PARITY)
def test_lora_training_matches_single_process(world, case, request):
    check_parity(request.getfixturevalue(world)[case])


@pytest.mark.slow
def test_lora_3d_matches_single_process(world4):
    check_parity(world4["lora_3d_auto"])


@pytest.mark.slow
@pytest.mark.parametrize("world", ["world2", "world4"])
def test_tied_embeddings_stay_tied_under_lora(world, request):
    assert request.getfixturevalue(world)["lora_tied_2d_auto"]["still_tied"]
