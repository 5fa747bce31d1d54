"""Mixture-of-Experts models with and without expert parallelism, through real Trainers on 2 and 4 gloo ranks (cases
in `tests/workers/moe.py`; skipped without transformers): tiny Qwen3-MoE and Mixtral (4 experts, top-2) and the
example GPT's MoE variant, each against single-process training on the same global batches."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers")


ATOL = 1e-5


SHARED_LAUNCH = {2: "moe", 4: "moe"}


@pytest.fixture(scope="module")
def moe2(shared_launch):
    return shared_launch(2)


@pytest.fixture(scope="module")
def moe4(shared_launch):
    return shared_launch(4)


@pytest.mark.slow
@pytest.mark.parametrize("world", ["moe2", "moe4"])
@pytest.mark.parametrize(
    "case",
    ["qwen3_moe_fsdp", "qwen3_moe_ep", "qwen3_moe_ep_checkpointed", "example_moe_ep", "example_moe_ep_grouped_mm"],
)
def test_moe_matches_single_process_training(world, case, request):
    """FSDP alone, and expert parallelism over every rank (EP 2, EP 4): the expert gradients are averaged over the
    global batch, neither divided by the expert-parallel size twice nor left summed (either would show here)."""
    result = request.getfixturevalue(world)[case]
    assert result["max_abs_diff"] < ATOL


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "local_rows", "placements"),
    [
        ("qwen3_moe_ep2_fsdp2", 1, "(_StridedShard(dim=0, sf=2), Shard(dim=0))"),
        ("mixtral_ep2_fsdp2", 1, "(_StridedShard(dim=0, sf=2), Shard(dim=0))"),
        ("qwen3_moe_ep2_tp2", 2, "(_StridedShard(dim=0, sf=2), Shard(dim=0))"),  # attention TP 2, experts EP 2
        ("qwen3_moe_pp2_ep2", 2, "(_StridedShard(dim=0, sf=2), Shard(dim=0))"),  # 2 stages, EP 2 in each
        ("qwen3_moe_hsdp_ep2", 2, "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))"),
    ],
)
def test_expert_parallel_layouts_match_single_process_training(moe4, case, local_rows, placements):
    """EP composed with FSDP over the ranks left over, tensor parallelism, pipeline stages and HSDP: each rank holds
    4 / EP experts (FSDP-sharded over what is left) and trains as one process does."""
    result = moe4[case]
    assert result["max_abs_diff"] < ATOL
    assert (result["local_rows"], result["placements"]) == (local_rows, placements)


@pytest.mark.slow
@pytest.mark.parametrize("world", ["moe2", "moe4"])
def test_an_expert_no_token_chooses_gets_a_zero_gradient(world, request):
    """The router never picks the last expert: its rank gets no token for it (on 4 ranks, no token at all), yet
    every collective runs, training matches one process, and that expert's weights stay exactly as initialised."""
    result = request.getfixturevalue(world)["example_moe_idle_expert"]
    assert result["max_abs_diff"] < ATOL
    assert set(result["last_expert_moved"].values()) == {0.0}


@pytest.mark.slow
@pytest.mark.parametrize("world", ["moe2", "moe4"])
def test_clipping_spans_expert_and_other_gradients_once(world, request):
    """`gradient_clip_val` clips the global norm over expert and non-expert gradients, each counted once: the same
    update as `clip_grad_norm_` in one process, whose norms (about 0.95) are well above the 0.05 bound."""
    result = request.getfixturevalue(world)["qwen3_moe_ep_clipped"]
    assert min(result["reference_norms"]) > 0.5
    assert result["max_abs_diff"] < ATOL


@pytest.mark.slow
def test_checkpoints_reshard_between_expert_parallel_sizes(moe4):
    """EP 2 x FSDP 2 -> FSDP 4 -> EP 4, each resuming the previous stage's sharded checkpoint: the loaded model and
    optimizer state equal the saved one exactly (expert keys are the unsplit model's), and each stage continues at
    the exact next batch, matching single-process training."""
    stages = moe4["moe_reshard_chain"]
    assert list(stages) == ["ep2_step2", "ep1_step3", "ep4_step4"]
    assert [stage["global_step"] for stage in stages.values()] == [2, 3, 4]
    assert [stage["load_diff"] for stage in stages.values()] == [None, 0.0, 0.0]
    assert all(stage["max_abs_diff"] < ATOL for stage in stages.values())


@pytest.mark.slow
@pytest.mark.parametrize("world", ["moe2", "moe4"])
@pytest.mark.parametrize("case", ["qwen3_moe_aux_fsdp", "qwen3_moe_aux_ep"])
def test_router_load_balancing_loss_covers_the_global_batch(world, case, request):
    """`output_router_logits=True`, `router_aux_loss_coef=0.1`: the load-balancing loss is a product of two batch
    means, so each rank's own would differ from one process's (3.4e-3 on these weights after 3 steps); it is
    computed over every data-parallel rank's routing, with or without expert parallelism."""
    result = request.getfixturevalue(world)[case]
    assert result["max_abs_diff"] < ATOL


@pytest.mark.slow
@pytest.mark.parametrize("world", ["moe2", "moe4"])
def test_gradient_accumulation_under_expert_parallelism(world, request):
    """`accumulate_grad_batches=2`: the experts' gradient sync is skipped on the first micro-batch (their FSDP unit
    sits under the top-level units `no_sync` controls) and the step matches one process on the merged batches."""
    assert request.getfixturevalue(world)["qwen3_moe_ep_accumulated"]["max_abs_diff"] < ATOL


@pytest.mark.slow
@pytest.mark.parametrize("world", ["moe2", "moe4"])
@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("ep_on_dense_refused", r"ValueError: `expert_parallel_size=2` needs Mixture-of-Experts layers, but .*GPT"),
        ("ep_indivisible_refused", r"ValueError: `expert_parallel_size=\d` does not divide the \d experts of"),
        ("ep_size_refused", r"ValueError: `expert_parallel_size=3` does not divide the data-parallel ranks"),
    ],
)
def test_wrong_expert_parallel_layouts_fail_on_every_rank(world, case, message, request):
    """Refused on every rank, before any collective (a rank left waiting in one would time the case out)."""
    messages = request.getfixturevalue(world)[case]
    assert len(messages) == int(world[-1])
    assert all(m is not None and re.match(message, m) for m in messages), messages


@pytest.mark.slow
def test_full_format_checkpoint_of_expert_parallel_training(moe4):
    """EP 4 saves one full-format file (the experts gathered whole on rank 0); FSDP 4 resumes it at the next batch."""
    result = moe4["moe_full_format"]
    assert result["is_file"]
    assert result["max_abs_diff"] < ATOL


@pytest.mark.slow
def test_expert_parallel_blocks_compile(moe2):
    """`compile=True` with EP 2: each block compiles around the dispatch, which runs eagerly, at parity."""
    assert moe2["example_moe_ep_compiled"]["max_abs_diff"] < ATOL
