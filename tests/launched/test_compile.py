"""The strategies' `compile` argument on 2 gloo ranks, through real Trainers (one launch for every compile case;
cases in `tests/workers/compile.py`). The argument's validation is tested in process in
`tests/unit/parallel/test_compilation.py`.

Tolerance: compiled and eager runs of the same strategy are compared with `COMPILE_ATOL = 1e-6`. Measured on this
CPU build (Inductor C++ backend, torch 2.13) the difference is exactly 0.0 for every case; fusion may reorder fp32
reductions on other backends, which moves the last bits (~1e-7 for these magnitudes), so 1e-6 allows that and
nothing more: a missing gradient all-reduce or a skipped block shows up as >1e-3 after six Adam steps.
"""

from __future__ import annotations

import pytest

from tests.conftest import run_workers

COMPILE_ATOL = 1e-6
CASES = [
    "fsdp",
    "fsdp_activation_checkpointing",
    "2d",
    "2d_tensor_parallel_input_layer",
    "replicate",
    "replicate_bf16_hook",
    "replicate_fp16_hook",
    "replicate_compiled_autograd",
    "replicate_compiled_autograd_bf16_hook",
]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return run_workers(2, "compile,compile_resume", tmp_path_factory.mktemp("compile"))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_compiled_matches_eager(compiled, case):
    result = compiled[f"compile_{case}"]
    assert result["steps"] == 6
    assert result["loss_max_diff"] <= COMPILE_ATOL
    assert result["param_max_diff"] <= COMPILE_ATOL


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_each_block_is_compiled_in_place_and_keys_are_unchanged(compiled, case):
    result = compiled[f"compile_{case}"]
    assert result["compiled_units"] == ["model.layers.0", "model.layers.1"]
    assert result["state_keys_equal"] and result["checkpoint_keys_equal"]
    assert not result["orig_mod_in_keys"]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_no_recompile_after_the_first_step(compiled, case):
    result = compiled[f"compile_{case}"]
    # Everything is compiled during step 1 (dynamo is reset before each case); steps 2..6 add nothing.
    assert 1 <= result["new_graphs_per_step"][0] <= 2
    assert result["new_graphs_per_step"][1:] == [0] * 5
    assert result["backward_captures_per_step"][1:] == [0] * 5


@pytest.mark.slow
def test_tensor_parallel_layer_feeding_a_compiled_block_gets_its_gradient(compiled):
    """A row-wise layer outside the compiled blocks hands its all-reduced output to the first block as an
    `AsyncCollectiveTensor`; torch 2.13 compiles the block as if that input needed no gradient. Without the wait the
    strategy inserts (`wait_before_compiled_units`) the layer got no gradient: measured 0.11 loss and 0.057 parameter
    difference after 6 steps, and a third graph for the first block's other input type."""
    result = compiled["compile_2d_tensor_parallel_input_layer"]
    assert result["param_max_diff"] <= COMPILE_ATOL
    assert result["new_graphs_per_step"][0] == 2  # one graph per block, the same input type for both


@pytest.mark.slow
def test_compiled_autograd_captures_backward_and_buckets_allreduce(compiled):
    result = compiled["compile_replicate_compiled_autograd"]
    assert result["backward_captures_per_step"][0] == 1
    assert result["inductor_ddp_buckets"] >= 1  # Inductor fused the per-parameter all-reduces into buckets
    assert compiled["compile_replicate"]["backward_captures_per_step"] == [0] * 6  # eager autograd without the flag


@pytest.mark.slow
def test_checkpoint_of_compiled_run_loads_into_eager_run(compiled):
    result = compiled["compile_resume"]
    assert result["same_keys"] and result["global_step"] == 2
    assert result["max_abs_diff"] == 0.0
