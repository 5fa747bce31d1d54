"""The strategies under a real Lightning Fabric loop on 2 and 4 gloo ranks (cases in `tests/workers/fabric.py`):
parity with one process under replicate, FSDP, HSDP, TP 2, TP 2 x FSDP 2, DDP + TP 2 and expert parallelism, with
accumulation (`fabric.no_backward_sync`) and clipping (`fabric.clip_gradients`); a 4-rank save loaded on 2 ranks
into a model built on the meta device continues exactly; the Trainer <-> Fabric checkpoint round trip and
`consolidate`; and the refusals, alike on every rank."""

from __future__ import annotations

import pytest

from tests.conftest import run_workers

ATOL = 1e-5

PARITY = ["fabric_fsdp", "fabric_fsdp_apart", "fabric_replicate", "fabric_hsdp", "fabric_tp2", "fabric_replicate_tp2"]

REFUSALS = {
    "fabric_refuses_pipeline": ["pipeline_parallel_size=2", "cannot run under Fabric", "with the Trainer"],
    "fabric_refuses_context_parallel": ["context_parallel_size='auto'", "cannot run under Fabric"],
    "fabric_refuses_bad_tp_size": ["tensor_parallel_size=3", "does not divide the world size"],
    "fabric_refuses_unmatched_plan": ["'model.layers.*.fc9' matches no module"],
    "fabric_refuses_fp16": ["'16-true'", "bf16-mixed"],
    "fabric_refuses_stepped_optimizer": ["already holds state", "fabric.setup_optimizers"],
}


SHARED_LAUNCH = {2: "fabric,fabric_refusals,fabric_moe", 4: "fabric,fabric_refusals,fabric_moe"}


@pytest.fixture(scope="module", params=[2, 4])
def fabric_world(request, shared_launch):
    return request.param, shared_launch(request.param)


@pytest.mark.slow
@pytest.mark.parametrize("case", PARITY)
def test_fabric_loop_trains_like_one_process(fabric_world, case):
    _, results = fabric_world
    result = results[case]
    assert result["max_abs_diff"] < ATOL
    if case != "fabric_fsdp_apart":
        assert result["clipped"]  # the clipping norm was reached: clipping took part


@pytest.mark.slow
def test_trainer_checkpoint_loads_in_fabric_and_continues(fabric_world):
    _, results = fabric_world
    result = results["fabric_trainer_to_fabric"]
    assert result["loaded_equals_trained"] == 0.0
    assert result["trainer_keys_left"]  # the Trainer's own keys come back as Fabric's remainder
    assert result["max_abs_diff"] < ATOL


@pytest.mark.slow
def test_fabric_checkpoint_loads_in_a_trainer_and_consolidates(fabric_world):
    _, results = fabric_world
    result = results["fabric_fabric_to_trainer"]
    assert result["trainer_equals_saved"] == 0.0
    assert result["consolidated_equals_saved"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_fabric_refuses_on_every_rank_with_the_fix(fabric_world, case):
    world, results = fabric_world
    messages = results[case]
    assert len(messages) == world and len(set(messages)) == 1, messages  # every rank, the same error
    for fragment in REFUSALS[case]:
        assert fragment in messages[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fabric_example_moe_ep", "fabric_qwen3_moe_router_loss_ep"])
def test_expert_parallel_moe_in_a_fabric_loop_trains_like_one_process(fabric_world, case):
    """Experts split over every rank, accumulation and clipping; a transformers MoE's load-balancing loss over the
    global micro-batch, as one process computes it."""
    _, results = fabric_world
    assert results[case]["max_abs_diff"] < ATOL


@pytest.mark.slow
def test_a_root_transformers_moe_with_router_logits_is_refused_on_every_rank(fabric_world):
    world, results = fabric_world
    messages = results["fabric_refuses_bare_moe_with_router_loss"]
    assert len(messages) == world and len(set(messages)) == 1, messages
    assert "`output_router_logits=True` as the model itself" in messages[0]


@pytest.mark.slow
def test_save_on_4_ranks_loads_on_2_and_continues_exactly(tmp_path):
    saved = run_workers(4, "fabric_save_4", tmp_path)["fabric_save_4"]  # the two launches share `tmp_path`
    assert ".metadata" in saved["files"]  # a sharded (DCP) directory
    loaded = run_workers(2, "fabric_load_2", tmp_path)["fabric_load_2"]
    assert loaded["built_on_meta"]
    assert loaded["step"] == 2
    assert loaded["max_abs_diff"] < ATOL
