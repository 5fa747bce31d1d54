"""The non-finite step guard (`lightning_dpar.optim.nonfinite`) through real Trainers on 2 and 4 gloo ranks (cases in
`tests/workers/nonfinite.py`, in the shared launch): a NaN or Inf in one rank's local gradient shard after the
reduction, in one rank's loss, or in one pipeline stage only, under DDP, FSDP, HSDP, 2D and pipeline parallelism,
with and without gradient-norm clipping, and under expert and context parallelism. `"raise"` stops every rank
before the step naming the step and the parameter (the weights are those of the steps before); `"skip"` ends equal
to one process that skipped that step, with the skip counted on every rank. No case hangs (each would time out)."""

from __future__ import annotations

import pytest

from tests.workers.nonfinite import BAD_RANK, BAD_STEP

SHARED_LAUNCH = {2: "nonfinite", 4: "nonfinite"}
ATOL = 1e-5

CASES = {
    2: [
        "replicate_grad_nan_raise_clip",
        "fsdp_loss_inf_skip",
        "two_d_grad_inf_skip_clip",
        "pipeline_stage_grad_nan_raise",
        "pipeline_stage_grad_inf_skip_clip",
    ],
}
CASES[4] = CASES[2] + ["hsdp_grad_nan_skip_clip", "two_d_loss_nan_raise"]


@pytest.mark.slow
@pytest.mark.parametrize("world,name", [(w, n) for w, names in CASES.items() for n in names])
def test_nonfinite_step_raises_or_skips_on_every_rank(shared_launch, world, name):
    result = shared_launch(world)[f"nonfinite{world}_{name}"]
    errors = result["errors"]
    assert result["max_abs_diff"] < ATOL, result  # raise: the weights before the step; skip: one process skipping
    if name.endswith(("raise", "raise_clip")):
        assert all(e is not None and e["type"] == "NonFiniteError" for e in errors), errors
        assert len({e["message"] for e in errors}) == 1, errors  # the same verdict on every rank
        message = errors[0]["message"]
        assert f"global step {BAD_STEP}" in message, message
        assert result["global_step"] == BAD_STEP, result
        if "_loss_" in name:
            assert f"the loss on ranks [{BAD_RANK}]" in message, message
        else:
            (poisoned,) = result["poisoned"]
            assert f"rank {BAD_RANK}: {poisoned}" in message, message
    else:
        assert errors == [None] * world, errors
        assert result["skipped_metric"] == [1.0] * world, result  # in `callback_metrics` on every rank


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ep_grad_nan_raise", "cp_grad_nan_raise"])
def test_expert_and_context_parallel_steps_stop_on_every_rank(shared_launch, name):
    result = shared_launch(2)[f"nonfinite2_{name}"]
    errors = result["errors"]
    assert all(e is not None and e["type"] == "NonFiniteError" for e in errors), errors
    assert len({e["message"] for e in errors}) == 1, errors
    (poisoned,) = result["poisoned"]
    assert f"global step {BAD_STEP}: the gradients of rank {BAD_RANK}: {poisoned}" in errors[0]["message"], errors


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_with_every_value_finite_the_guard_changes_no_bit_under_2d_clipping(shared_launch, world):
    assert shared_launch(world)[f"nonfinite{world}_two_d_clip_bit_parity"] is True
