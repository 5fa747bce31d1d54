"""Checkpointing through real Trainers on 1, 2 and 4 gloo ranks (workers in `tests/workers/checkpoint.py`).

One directory is shared by every launch of this module: the resharding chain saves under one layout in one launch
and loads under the next layout in the next launch; the kill test's second launch inspects what the killed one left.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, WORKERS, run_workers, subprocess_env


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def results(shared_dir):
    """All launches, in dependency order; each returns rank 0's results, merged here."""
    merged: dict = {}
    merged.update(run_workers(4, "ckpt_chain_a,ckpt_position_save", shared_dir))
    world2 = (
        "ckpt_chain_bc,ckpt_position_load,ckpt_bad_input,ckpt_resume,ckpt_resume_last,ckpt_full_format,ckpt_migrate"
    )
    merged.update(run_workers(2, world2, shared_dir))
    merged.update(run_workers(1, "ckpt_chain_d,ckpt_memory_fs,ckpt_export,ckpt_export_memory", shared_dir))
    merged.update(run_workers(2, "ckpt_chain_e", shared_dir))
    return merged


# ---------------------------------------------------------------------- Lightning's flow and exact resume
RESUME_CASES = ["fsdp", "replicate", "2d", "fsdp_async", "fsdp_full", "fsdp_custom_sampler"]


@pytest.mark.slow
@pytest.mark.parametrize("case", RESUME_CASES)
def test_resume_mid_epoch_reproduces_the_uninterrupted_losses(results, case):
    """Resumed at step 5 of a 16-step epoch (shuffle, per-rank noise, Adam, per-step LR schedule), on every rank
    the next 15 losses, across the epoch boundary, equal the uninterrupted run's exactly (sharded, async-written and
    full-format checkpoints)."""
    result = results[f"resume_{case}"]
    assert result["resumed_first_step"] == 5
    assert len(result["resumed"][0]) == 15
    assert result["resumed"] == result["full_after_5"]


@pytest.mark.slow
@pytest.mark.parametrize("case", RESUME_CASES)
def test_model_checkpoint_bookkeeping_sees_only_complete_checkpoints(results, case):
    result = results[f"resume_{case}"]
    assert result["every_dir"] == ["step=10.ckpt", "step=15.ckpt", "step=20.ckpt", "step=5.ckpt"]
    # save_top_k=2 on val_loss deleted the other directories; no temporary directory is left behind.
    assert result["top_dir"] == ["last.ckpt", *result["best_k"]]
    assert len(result["best_k"]) == 2
    assert result["last_model_path"] == "last.ckpt"


@pytest.mark.slow
@pytest.mark.parametrize("case", RESUME_CASES)
def test_validate_from_checkpoint_matches_trained_model(results, case):
    result = results[f"resume_{case}"]
    assert result["val_from_last"] == result["val_after_fit"]
    assert "nope.ckpt" in result["missing_ckpt_error"] and "does not exist" in result["missing_ckpt_error"]


@pytest.mark.slow
def test_fit_ckpt_path_last(results):
    result = results["resume_last"]
    assert result["first_step"] == 6
    assert result["final_step"] == 9
    assert not [name for name in result["dir"] if name.startswith(".")]


# ---------------------------------------------------------------------- resharding
@pytest.mark.slow
@pytest.mark.parametrize("stage", ["b", "c", "d", "e"])
def test_resharding_chain_keeps_model_and_optimizer_exact(results, stage):
    """2d on 4 -> fsdp on 2 -> replicate on 2 -> fsdp on 1 -> 2d on 2: full params and Adam state bit-identical."""
    result = results[f"chain_{stage}"]
    assert result["max_diff_to_previous"] == 0.0
    assert result["keys"] > 40  # model params + exp_avg, exp_avg_sq, step per param + param-group values
    assert result["global_step"] == 4
    assert result["lr"] == results["chain_a"]["lr"]  # scheduler state came along


@pytest.mark.slow
def test_data_position_maps_to_a_new_data_parallel_size(results):
    """3 steps on 4 data-parallel ranks, then the rest of the epoch on 2: every sample exactly once."""
    before, after = results["position_save"]["seen"], results["position_load"]["seen"]
    assert len(before) == 3 * 4 * 4
    assert not set(before) & set(after)
    assert sorted(before + after) == list(range(128))
    assert results["position_load"]["global_step"] == 3 + (128 - 48) // (2 * 4)


# ---------------------------------------------------------------------- strict loading and bad input
@pytest.mark.slow
def test_strict_loading_false_loads_matching_keys_and_reports_the_rest(results):
    rank0 = results["bad_input"]["per_rank"][0]
    assert rank0["lenient_max_diff"] == 0.0
    assert rank0["lenient_extra_is_fresh"] is True
    assert "not in the checkpoint (left as they were): ['extra.bias', 'extra.weight']" in rank0["lenient_warning"]
    assert "not in the model (ignored): ['extra.bias', 'extra.weight']" in rank0["lenient_unexpected_warning"]
    assert "not in the checkpoint (left as they were): ['extra.bias', 'extra.weight']" in rank0["lenient_full_warning"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("strict_extra", ["missing in the checkpoint: ['extra.bias', 'extra.weight']", "strict_loading = false"]),
        ("incompatible", ["other shapes", "model.layers.0.fc1.weight: checkpoint (12, 15), model (8, 15)"]),
        ("missing", ["missing.ckpt", "does not exist"]),
        ("not_a_checkpoint", ["not_a_checkpoint", "lacks '.metadata', 'meta.pt'"]),
        ("not_a_checkpoint_file", ["notes.txt", "not written by `torch.save`"]),
        ("truncated", ["truncated.ckpt/__1_0.distcp", "is truncated"]),
        ("corrupted", ["corrupted.ckpt/__0_0.distcp", "is corrupted"]),
        ("newer_sharded", ["newer_sharded.ckpt", "written in checkpoint format 99", "Upgrade lightning_dpar"]),
        ("newer_full", ["newer_full.ckpt", "written in checkpoint format 99", "Upgrade lightning_dpar"]),
    ],
)
def test_bad_checkpoint_fails_on_every_rank_naming_path_and_problem(results, case, expected):
    for rank_result in results["bad_input"]["per_rank"]:
        message = rank_result[case]
        assert message is not None and message.startswith("CheckpointLoadError")
        for fragment in expected:
            assert fragment.lower() in message.lower()


# ---------------------------------------------------------------------- kill during save
@pytest.fixture(scope="module")
def after_kill(tmp_path_factory):
    """A 2-rank training saving every step; rank 0 is SIGKILLed inside its third save (all shards written, no
    metadata yet). A fresh launch then loads what is left."""
    shared = tmp_path_factory.mktemp("kill")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(WORKERS / "run.py"), "ckpt_kill", str(shared / "killed.json")]
    killed = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=subprocess_env(), cwd=ROOT)
    assert killed.returncode != 0 and "SIGKILL" in killed.stdout + killed.stderr
    return run_workers(2, "ckpt_after_kill", shared)["after_kill"]


@pytest.mark.slow
def test_kill_during_save_leaves_earlier_checkpoints_loadable(after_kill):
    visible = [name for name in after_kill["names"] if not name.startswith(".")]
    assert visible == ["last.ckpt", "step=1.ckpt"]  # step=2.ckpt never appeared under its name
    # Resuming from the checkpoint and from "last" (ModelCheckpoint's lookup) both continue after step 1.
    assert after_kill["first_step"] == {"step=1.ckpt": 1, "last.ckpt": 1}


@pytest.mark.slow
def test_kill_during_save_partial_checkpoint_is_hidden_and_refused(after_kill):
    assert len(after_kill["partial"]) == 1
    assert ".metadata" in after_kill["partial_content"] and "meta.pt" not in after_kill["partial_content"]
    assert "incomplete checkpoint" in after_kill["refused"] and after_kill["partial"][0] in after_kill["refused"]


# ---------------------------------------------------------------------- formats, paths, tools, migration
@pytest.mark.slow
def test_full_format_is_one_file_every_reader_accepts(results):
    result = results["full_format"]
    assert result["is_file"]
    assert result["plain_load_diff"] == 0.0  # torch.load(weights_only=True)
    assert result["load_from_checkpoint_diff"] == 0.0  # LightningModule.load_from_checkpoint
    assert result["dpar_resume_diff"] == 0.0  # fit(ckpt_path=file) under another dpar strategy
    assert result["optimizer_keys"] == [0, 1, 2]  # keyed by position like a plain optimizer


@pytest.mark.slow
def test_fsspec_urls(results):
    assert results["full_format"]["file_url_diff"] == 0.0  # file:// on 2 ranks
    memory = results["memory_fs"]  # memory:// through ModelCheckpoint (save_top_k=1 removed older dirs)
    assert memory["listing"] == ["step=6.ckpt"]
    assert memory["files"] == [".metadata", "__0_0.distcp", "meta.pt"]
    assert memory["load_diff"] == 0.0


@pytest.mark.slow
def test_consolidate_2d_checkpoint_to_lightning_ckpt_and_safetensors(results):
    """The 4-rank TP+FSDP checkpoint, consolidated in one process."""
    export = results["export"]
    assert export["codes"] == [0, 0, 1]  # lightning, safetensors, and a truncated checkpoint refused
    assert export["ckpt_model_diff"] == 0.0
    assert export["ckpt_optimizer_diff"] == 0.0
    assert export["ckpt_param_ids"] == list(range(12))
    assert export["safetensors_files"] >= 2 and export["safetensors_index"]
    assert export["safetensors_diff"] == 0.0


@pytest.mark.slow
def test_consolidated_ckpt_resumes_on_a_plain_single_device_trainer(results):
    export = results["export"]
    assert export["plain_resume_first_step"] == 4
    assert export["plain_resume_final_step"] == 6


@pytest.mark.slow
def test_load_from_checkpoint_helper_reads_a_sharded_directory(results):
    assert results["export"]["helper_diff"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("source", ["model_parallel", "fsdp_strategy_sharded"])
def test_resume_from_lightning_strategies_checkpoints(results, source):
    result = results[f"migrate_{source}"]
    assert result["layout"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert result["model_diff"] == 0.0
    assert result["optimizer_diff"] == 0.0
    assert result["first_step"] == 4


@pytest.mark.slow
def test_safetensors_export_streams(results):
    """Peak RSS growth of `consolidate` on a 128 MiB model of 4 MiB tensors, each in a fresh process: the
    safetensors export holds a few tensors at a time; the single .ckpt holds the whole model."""
    memory = results["export_memory"]
    growth = memory["peak_growth_mib"]
    assert isinstance(growth["safetensors"], float), growth["safetensors"]
    assert growth["safetensors"] < memory["model_mib"] / 3
    assert growth["lightning"] > memory["model_mib"] * 0.9  # the contrast: the measurement sees a whole model


def test_async_save_is_settable_between_saves_and_needs_the_sharded_format():
    import lightning_dpar

    strategy = lightning_dpar.FullyShardStrategy(async_save=True)
    assert strategy.async_save
    strategy.async_save = False
    assert not strategy.async_save
    with pytest.raises(ValueError, match=r"`async_save=True` needs `checkpoint_format='sharded'`, not 'full'"):
        lightning_dpar.FullyShardStrategy(checkpoint_format="full", async_save=True)
    full = lightning_dpar.ReplicateStrategy(checkpoint_format="full")
    with pytest.raises(ValueError, match="not 'full'"):
        full.async_save = True
