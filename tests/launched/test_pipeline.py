"""Pipeline parallelism through real Trainers on 2 and 4 gloo ranks (cases in `tests/workers/pipeline.py`).

Parity: PP 2 (2 ranks), PP 2 x FSDP 2 and PP 2 x TP 2 (4 ranks), each with GPipe, 1F1B, Interleaved1F1B and the
zero-bubble ZBV schedule, under SGD and AdamW, end with the parameters of single-process training on the same global
batches, with fp32 tolerance; every rank logs the true loss. Around the step: accumulation, clipping by the global
norm, evaluation, bf16, meta-device init per stage, the data each rank sees, errors before any collective.
Checkpoints: saved under PP 2 x FSDP 2, resumed exactly under `dpar_fsdp` on 2 ranks, and back into PP 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.torch_version import TorchVersion

from tests.conftest import LaunchResults, run_workers
from tests.workers.checkpoint_common import inputs_env

ATOL = 1e-5
#: The V schedule is refused on the CPU before torch 2.13 (`ScheduleSpec.check_runs_on`; tests/unit/pipeline).
SCHEDULES = [
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    pytest.param(
        "ZBVZeroBubble",
        marks=pytest.mark.skipif(TorchVersion(torch.__version__) < (2, 13), reason="refused on gloo before torch 2.13"),
    ),
]
OPTIMIZERS = ["sgd", "adamw"]


@dataclass(frozen=True)
class Launch:
    results: LaunchResults
    directory: Path


@pytest.fixture(scope="module")
def pp4(tmp_path_factory) -> Launch:
    directory = tmp_path_factory.mktemp("pp4")
    groups = "pipeline_parity,pipeline_errors,pipeline_metrics,pipeline_checkpoint_save"
    return Launch(run_workers(4, groups, directory, timeout=600), directory)


@pytest.fixture(scope="module")
def pp2(pp4, tmp_path_factory) -> Launch:
    directory = tmp_path_factory.mktemp("pp2")
    inputs = inputs_env(pp_save=pp4.directory / "pp_save", pp_resume_fsdp=directory / "pp_resume_fsdp")
    groups = "pipeline_parity,pipeline_features,pipeline_metrics,pipeline_checkpoint_resume"
    return Launch(run_workers(2, groups, directory, timeout=600, extra_env=inputs), directory)


def _check_parity(result: dict, ranks: int) -> None:
    assert result["max_abs_diff"] < ATOL, result
    assert result["logged_loss_diff"] < ATOL, result
    assert result["logged_on_ranks"] == ranks, result


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_parity(pp2, schedule, optimizer):
    _check_parity(pp2.results[f"pp_{schedule}_{optimizer}"], ranks=2)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("layout", ["pp_fsdp", "pp_tp"])
def test_pp2_times_fsdp2_and_tp2_parity(pp4, layout, schedule, optimizer):
    _check_parity(pp4.results[f"{layout}_{schedule}_{optimizer}"], ranks=4)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("launch", "case"),
    [("pp2", "pp_uneven"), ("pp4", "pp_fsdp_uneven"), ("pp4", "pp_tp_uneven"), ("pp2", "pp_explicit_split")],
)
def test_uneven_and_explicit_splits(request, launch, case):
    """3 blocks over 2 stages (auto: one stage takes 2), and an explicit split point."""
    results = request.getfixturevalue(launch).results
    _check_parity(results[case], ranks=int(launch[-1]))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["pp_accumulate", "pp_clip_norm", "pp_microbatches_4"])
def test_accumulation_clipping_and_microbatches(pp2, case):
    result = pp2.results[case]
    assert result["max_abs_diff"] < ATOL, result
    assert result["logged_on_ranks"] == 2, result


@pytest.mark.slow
def test_a_model_registering_its_head_first_trains_with_its_call_order(pp2):
    assert pp2.results["pp_head_registered_first"]["max_abs_diff"] < ATOL


@pytest.mark.slow
def test_evaluation_runs_forward_only_and_every_rank_gets_the_results(pp2):
    result = pp2.results["pp_evaluation"]
    assert result["val_loss_diff"] < ATOL and result["test_loss_diff"] < ATOL, result
    assert result["prediction_diff"] < ATOL, result
    # PP 2 on 2 ranks is one data-parallel rank: both stages return every prediction.
    assert result["predicted_samples"] == [result["dataset"]] * 2, result


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["pp2", "pp4"])
def test_logged_metric_objects_have_the_last_stages_value_on_every_rank(request, launch):
    """A torchmetrics metric updated on the last stage is logged on every rank; it reduces over data-parallel peers
    only (a sum over all ranks would count each sample once per stage)."""
    result = request.getfixturevalue(launch).results["pp_metrics"]
    assert result["mse_diff"] < ATOL, result
    assert result["samples"] == [result["dataset"]] * int(launch[-1]), result
    # Logged on_step (each data-parallel rank its own batch's value): the two stages of a pipeline log the same.
    stage_0, stage_1 = (
        result["train_mse"][: len(result["train_mse"]) // 2],
        result["train_mse"][len(result["train_mse"]) // 2 :],
    )
    assert stage_0 == stage_1 and min(stage_0) > 0, result


@pytest.mark.slow
def test_compile_and_activation_checkpointing_apply_per_block_within_each_stage(pp2):
    result = pp2.results["pp_compile_and_checkpointing"]
    _check_parity(result, ranks=2)
    assert result["compiled"] == [["model.layers.0"], ["model.layers.1"]], result  # each stage's own block
    assert result["checkpointed"] == result["compiled"], result


@pytest.mark.slow
def test_bf16_mixed_matches_a_bf16_reference(pp2):
    result = pp2.results["pp_bf16"]
    assert result["dtypes"] == ["torch.float32"], result  # fp32 master weights
    assert result["max_abs_diff"] < 1e-6, result
    assert result["diff_to_fp32"] > 1e-5, result  # it did compute in bf16


@pytest.mark.slow
def test_meta_init_allocates_only_the_own_stage(pp2):
    result = pp2.results["pp_meta_init"]
    assert result["filled"] == result["stage_size"], result
    assert all(size < result["total"] for size in result["stage_size"]), result
    assert sum(result["stage_size"]) == result["total"], result
    assert all(result["remote_units"]) and result["meta_left"] == [[], []], result


@pytest.mark.slow
def test_pipeline_and_data_parallel_peers_see_the_right_batches(pp2):
    result = pp2.results["pp_sampler"]
    assert result["dims"] == ["pipeline", "replicate", "shard", "tensor_parallel"], result
    assert result["seen"][0] == result["seen"][1], result  # the two stages of one pipeline


@pytest.mark.slow
def test_checkpoint_resumes_exactly_under_fsdp_and_back_into_the_pipeline(pp2):
    resumed = pp2.results["pp_resume_fsdp"]
    assert resumed["max_diff"] < ATOL and resumed["same_samples"] and resumed["global_step"] == 4, resumed
    back = pp2.results["pp_back_into_pipeline"]
    assert back["max_diff"] < ATOL and back["keys"] == resumed["keys"], back
    assert back["continued_to"] == 6, back
    exported = pp2.results["pp_consolidate"]
    assert exported["code"] == 0 and exported["max_diff"] < ATOL, exported


PP_ERRORS = {
    "pp_not_dividing_world": ["pipeline_parallel_size=5", "does not divide the world size 4", "[1, 2, 4]"],
    "pp_too_few_microbatches": ["'1F1B'", "pipeline_microbatches=1", "2 stages"],
    "pp_split_names_no_module": ["'model.layers.9' names no module", "'model.layers.0'"],
    "pp_empty_stage": ["4 pipeline stages need at least 4 blocks", "has 2"],
    "pp_batch_not_divisible": ["pipeline_microbatches=2", "gives batches of 3 and a last one of"],
    # Errors inside a step, found by the first step's forward-only pass and raised on every rank (none waits).
    "pp_step_returns_none": ["must return the loss", "it returned NoneType", "pipeline stage 1"],
    "pp_reused_layer": ["'model.layers.0' was called twice in one step"],
}


@pytest.mark.slow
def test_values_logged_per_microbatch_combine_by_their_reduce_fx(pp4):
    assert pp4.results["pp_summed_log"] == [float(4)] * 4  # 2 microbatches of 2 samples, summed: every rank


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(PP_ERRORS))
def test_bad_pipeline_input_fails_on_every_rank(pp4, case):
    messages = pp4.results[case]
    assert len(messages) == 4 and None not in messages, messages
    if case not in ("pp_step_returns_none", "pp_reused_layer"):
        assert len(set(messages)) == 1, messages
    for fragment in PP_ERRORS[case]:
        assert any(fragment in message for message in messages), messages
