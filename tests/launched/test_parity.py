"""Every strategy trains through a real Trainer on 1, 2 and 4 gloo ranks and ends with the parameters of
single-process training on the same global batches, with fp32 tolerance (cases in `tests/workers/parity.py`; the
launches, shared with other test files, are the `world*` fixtures of `tests/conftest.py`)."""

from __future__ import annotations

import pytest

from tests.conftest import WORLD_GROUPS

ATOL = 1e-5

PARITY_CASES = [
    *(f"2d_{opt}" for opt in ("sgd", "sgd_momentum", "sgd_foreach", "adam", "adamw")),
    "2d_accumulate",
    "2d_clip_norm",
    "2d_clip_value",
    "fsdp_sgd",
    "fsdp_adamw",
    "fsdp_accumulate",
    "fsdp_clip_norm",
    "replicate_sgd",
    "replicate_adam",
    "replicate_accumulate",
    "replicate_clip_norm",
    "replicate_static_graph",
    "replicate_find_unused",
    "replicate_callable_hook",
]

SHARED_LAUNCH = WORLD_GROUPS  # through the session fixtures `world4`, `world2`, `world1`


@pytest.mark.slow
@pytest.mark.parametrize("case", [*PARITY_CASES, "hsdp_adam", "replicate_tp_adamw"])
def test_parity_4_ranks(world4, case):
    assert world4[case]["max_abs_diff"] < ATOL


@pytest.mark.slow
@pytest.mark.parametrize("case", [*PARITY_CASES, "hsdp_adam", "replicate_tp_adamw"])
def test_parity_2_ranks(world2, case):
    assert world2[case]["max_abs_diff"] < ATOL


@pytest.mark.slow
@pytest.mark.parametrize("case", PARITY_CASES)
def test_parity_1_rank(world1, case):
    assert world1[case]["max_abs_diff"] < ATOL


@pytest.mark.slow
@pytest.mark.parametrize("world", ["world2", "world4"])
def test_replicate_comm_hooks(world, request):
    results = request.getfixturevalue(world)
    # Single-rank DDP never communicates, so only multi-rank runs exercise the hooks.
    assert results["replicate_callable_hook"]["hook_calls"] >= 3  # at least one bucket per step
    # bf16 rounding of the reduced gradients shows up, but stays at bf16's relative precision (2**-8).
    assert 1e-7 < results["replicate_bf16_compress"]["max_abs_diff"] < 2e-3
    if world == "world4":  # with TP, the names select FSDP2's gradient reduce dtype instead of a DDP hook
        assert 1e-7 < results["replicate_tp_bf16_compress"]["max_abs_diff"] < 2e-3


@pytest.mark.slow
@pytest.mark.parametrize("world", ["world1", "world2", "world4"])
@pytest.mark.parametrize("case", ["fsdp_shared_weights", "replicate_shared_weights"])
def test_parameters_shared_by_several_units_train_like_one_process(world, case, request):
    """A block reused by every layer (ALBERT-style) and, under FSDP, a tie across two top-level modules: each
    parameter is held by the unit enclosing its users, stays one parameter, and trains as in one process."""
    result = request.getfixturevalue(world)[case]
    assert result["max_abs_diff"] < ATOL
    assert result["block_still_shared"]
    assert result["top_level_still_tied"] == (case == "fsdp_shared_weights")
    assert result["params_before_after"][0] == result["params_before_after"][1]
