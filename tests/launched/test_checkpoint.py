"""Lightning's checkpoint flow through real Trainers on 2 gloo ranks (workers in `tests/workers/checkpoint.py`):
ModelCheckpoint, exact resume, `ckpt_path="last"`, strict loading, bad input, and a kill during a save.

Two launches: the kill (driven here with torchrun: it must die), then one launch of every other case, including
the after-kill cases, which load what the kill left (the `killed` fixture passes its directory). Resharding is
`tests/launched/test_checkpoint_reshard.py`; formats, fsspec and migration `tests/launched/test_checkpoint_formats.py`;
the `async_save` option in process `tests/unit/strategies/test_checkpoint_hooks.py`.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT, LaunchResults, run_workers, subprocess_env, workers_command
from tests.workers.checkpoint_common import inputs_env


@dataclass(frozen=True)
class Killed:
    """What the killed launch left: the directory it saved into, and how it ended."""

    directory: Path
    returncode: int
    output: str


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Killed:
    """A 2-rank training saving every step; rank 0 is SIGKILLed inside its third save (all shards written, no
    metadata yet). Not asserted here: the launch reading it also runs cases that do not need it."""
    shared = tmp_path_factory.mktemp("kill")
    cmd = workers_command(2, "ckpt_kill", shared / "records")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=subprocess_env(), cwd=ROOT)
    return Killed(shared / "kill", done.returncode, done.stdout + done.stderr)


@pytest.fixture(scope="module")
def results(killed, tmp_path_factory) -> LaunchResults:
    """Every case but the kill, in one 2-rank launch; each saves under its own directory."""
    groups = "ckpt_resume,ckpt_resume_last,ckpt_bad_input,ckpt_after_kill"
    return run_workers(2, groups, tmp_path_factory.mktemp("flow"), extra_env=inputs_env(kill=killed.directory))


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
def test_async_save_records_every_ranks_rng_with_no_collective_in_front(results):
    """`meta.pt` holds each rank's RNG streams as they were at the save, though rank 1's async save returned before
    rank 0 began its own (so the foreground gathered nothing); a resume restores each rank's own streams."""
    result = results["async_rng_record"]
    assert result["rank1_returned_first"], result
    assert result["ranks_differ"], result  # else a swap of ranks would go unnoticed
    assert result["recorded_ranks"] == 2
    assert result["recorded_matches"] == [True, True], result
    assert result["restored_matches"] == [True, True], result


@pytest.mark.slow
def test_fit_ckpt_path_last(results):
    result = results["resume_last"]
    assert result["first_step"] == 6
    assert result["final_step"] == 9
    assert not [name for name in result["dir"] if name.startswith(".")]


@pytest.mark.slow
def test_last_link_names_only_published_checkpoints(results):
    """With `save_last="link"` and async saves, `last.ckpt` moves to a checkpoint only once it is complete: a kill
    while the step-2 save is written leaves it naming step 1 (it used to name the unwritten step 2)."""
    result = results["async_link"]
    assert result["while_in_flight"] == {"target": "step=1.ckpt", "complete": True}
    assert result["after_fit"] == "step=3.ckpt"
    assert result["resumed_first_step"] == 3


# ---------------------------------------------------------------------- strict loading and bad input
@pytest.mark.slow
def test_strict_loading_false_loads_matching_keys_and_reports_the_rest(results):
    result = results["strict_loading_false_extra_layer"]
    assert result["lenient_max_diff"] == 0.0
    assert result["lenient_extra_is_fresh"] is True
    assert "not in the checkpoint (left as they were): ['extra.bias', 'extra.weight']" in result["lenient_warning"]


@pytest.mark.slow
def test_strict_loading_false_reports_keys_the_model_lacks(results):
    warning = results["strict_loading_false_unexpected_keys"]
    assert "not in the model (ignored): ['extra.bias', 'extra.weight']" in warning


@pytest.mark.slow
def test_strict_loading_false_from_a_full_format_file(results):
    warning = results["strict_loading_false_full_file"]
    assert "not in the checkpoint (left as they were): ['extra.bias', 'extra.weight']" in warning


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
    for message in results[f"bad_input_{case}"]:  # per rank
        assert message is not None and message.startswith("CheckpointLoadError")
        for fragment in expected:
            assert fragment.lower() in message.lower()


# ---------------------------------------------------------------------- kill during save
@pytest.mark.slow
def test_kill_during_save_leaves_earlier_checkpoints_loadable(killed, results):
    assert killed.returncode != 0 and "SIGKILL" in killed.output, killed.output[-3000:]
    after_kill = results["after_kill_resume"]
    visible = [name for name in after_kill["names"] if not name.startswith(".")]
    assert visible == ["last.ckpt", "step=1.ckpt"]  # step=2.ckpt never appeared under its name
    # Resuming from the checkpoint and from "last" (ModelCheckpoint's lookup) both continue after step 1.
    assert after_kill["first_step"] == {"step=1.ckpt": 1, "last.ckpt": 1}


@pytest.mark.slow
def test_kill_during_save_partial_checkpoint_is_hidden_and_refused(killed, results):
    assert killed.returncode != 0 and "SIGKILL" in killed.output, killed.output[-3000:]
    after_kill = results["after_kill_partial"]
    assert len(after_kill["partial"]) == 1
    assert ".metadata" in after_kill["partial_content"] and "meta.pt" not in after_kill["partial_content"]
    assert "incomplete checkpoint" in after_kill["refused"] and after_kill["partial"][0] in after_kill["refused"]
