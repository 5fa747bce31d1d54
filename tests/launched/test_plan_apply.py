"""Applying plans to ordinary models: blocks in top-level containers under every strategy, row-wise embeddings,
tensor-parallel sizes that do not fit the model, and DDP units that the model bypasses (real Trainers on 2 and 4
gloo ranks; cases in `tests/workers/plan_apply.py`). The pure checks that run before any collective are tested
in-process in `tests/unit/plan/test_structure.py` and `tests/unit/plan/test_tensor_parallel.py`."""

from __future__ import annotations

import pytest

ATOL = 1e-5
PARITY = [
    "top_level_blocks_replicate",
    "top_level_blocks_fsdp",
    "top_level_blocks_2d",
    "direct_parameters_replicate",
    "direct_parameters_fsdp",
    "direct_parameters_2d",
    "direct_parameters_replicate_tp",
    "embedding_rowwise_2d",
    "embedding_rowwise_replicate_tp",
]


SHARED_LAUNCH = {2: "ordinary,ordinary_errors,resume_message", 4: "ordinary"}


@pytest.fixture(scope="module")
def world2(shared_launch):
    return shared_launch(2)


@pytest.fixture(scope="module")
def world4(shared_launch):
    return shared_launch(4)


@pytest.mark.slow
@pytest.mark.parametrize("world", ["world2", "world4"])
@pytest.mark.parametrize("case", PARITY)
def test_parity_with_single_process_training(world, case, request):
    assert request.getfixturevalue(world)[case]["max_abs_diff"] < ATOL


@pytest.mark.slow
def test_a_unit_whose_forward_is_bypassed_is_refused_under_ddp(world2):
    messages = world2["bypassed_unit_replicate"]
    assert len(set(messages)) == 1 and messages[0] is not None  # every rank, same error: never a silent divergence
    assert "A parameter of 'body' received a gradient, but the `forward` of 'body' was not called" in messages[0]


@pytest.mark.slow
def test_tensor_parallel_size_not_dividing_a_dimension_fails_on_every_rank(world2):
    messages = world2["tp_does_not_divide"]
    assert len(set(messages)) == 1 and messages[0] is not None
    assert "`tensor_parallel_size=2` does not divide out_features=9 of module 'layers.0.fc1'" in messages[0]


@pytest.mark.slow
def test_trainers_one_after_another_in_one_process_add_no_process_groups(world2):
    result = world2["trainers_in_one_process"]
    assert result["same_meshes"], result
    first, *later = result["threads"]
    assert all(count < first + 3 for count in later), result  # one more gloo group would be three more threads


@pytest.mark.slow
def test_a_mid_epoch_resume_says_in_one_line_that_it_is_exact(world2):
    result = world2["resume_message"]
    assert result["lightning_warning"] == []  # "dataloader is not resumable" contradicted the exact resume
    assert result["resuming_lines"] == [
        "Resuming epoch 0 after 3 batches: exact (the distributed sampler continues from the checkpoint's position)."
    ]
