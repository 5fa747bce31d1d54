"""Exact resume from every kind of save, through real Trainers on 2 gloo ranks (workers in
`tests/workers/resume_points.py`): each checkpoint of one run, written by `ModelCheckpoint` (every n steps, on a
monitored metric, at epoch end), at the end of `fit`, by `trainer.save_checkpoint` and by `save_on_exception`,
resumes to the uninterrupted run's batches, learning rates and final state, or says in its log why not exactly.
"""

from __future__ import annotations

import pytest

from tests.conftest import LaunchResults

SHARED_LAUNCH = {2: "resume_points"}


@pytest.fixture(scope="module")
def results(shared_launch) -> LaunchResults:
    """Every resume point, in the shared 2-rank launch (the uninterrupted run is trained once, in the first case)."""
    return shared_launch(2)


#: Checkpoints of one 10-step run (4 batches an epoch, validation every 2) by how they were written: every 4 steps
#: (`every/`), at validation end on a monitored metric (`monitor/`), at each epoch's end (`epoch/`), at the end of
#: `fit` on `max_steps` mid-epoch and at an epoch's end (the README's flow), by `trainer.save_checkpoint` after `fit`,
#: and by `save_on_exception` after a crash.
EXACT_POINTS = [
    "monitor/step=2.ckpt",
    "monitor/step=4.ckpt",
    "epoch/step=4.ckpt",
    "fit_end_mid_epoch",
    "fit_end_epoch_end",
    "save_checkpoint_after_fit",
    "exception",
]


@pytest.mark.slow
@pytest.mark.parametrize("point", EXACT_POINTS)
def test_resume_from_every_kind_of_save_equals_the_uninterrupted_run(results, point):
    """The resumed run trains on every rank on the same batches with the same losses and learning rates (an
    `interval="step"` and an `interval="epoch"` `StepLR`) as the uninterrupted run from the checkpoint's step on,
    across the next epoch end, ends with the same weights and optimizer state bit for bit, and its log says "exact"
    (the end-of-fit and epoch-end saves used to start the next epoch: other batches, logged as exact)."""
    result = results[f"resume_point_{point}"]
    assert result["resumed_batches"] == result["expected_batches"]
    assert result["resumed_lrs"] == result["expected_lrs"]
    assert len(set(result["expected_lrs"])) > 2  # both schedulers stepped over the resumed steps
    assert result["same_batches"], result
    assert result["state_max_diff"] == 0.0
    assert [line for line in result["lines"] if line.startswith("Resuming")], result["lines"]
    assert all(": exact" in line for line in result["lines"] if line.startswith("Resuming")), result["lines"]


@pytest.mark.slow
@pytest.mark.parametrize("point", ["monitor/step=2.ckpt", "epoch/step=4.ckpt", "fit_end_epoch_end"])
def test_resume_with_an_epoch_plateau_scheduler_says_it_is_not_exact(results, point):
    """An `interval="epoch"` `ReduceLROnPlateau` is not stepped by Lightning at the end of the epoch a fit resumes in
    (its monitored metric is not in the checkpoint), though the uninterrupted run steps it there: the LR differs from
    the next epoch on (asserted, so the warning is not idle), and the resume log says "not exactly" and why, never
    "exact". The batches still continue in order."""
    result = results[f"resume_point_plateau/{point}"]
    assert result["resumed_batches"] == result["expected_batches"]
    assert result["resumed_lrs"] != result["expected_lrs"]
    lines = [line for line in result["lines"] if line.startswith("Resuming")]
    assert lines and all(line.startswith("Resuming not exactly") for line in lines), lines
    assert "ReduceLROnPlateau" in lines[0] and "'plateau_metric'" in lines[0] and "epoch 0" in lines[0], lines


@pytest.mark.slow
def test_resume_from_the_last_batch_end_before_validation_says_it_is_not_exact(results):
    """Saved in `on_train_batch_end` of the epoch's last batch, before the validation that follows it: Lightning's
    loop cannot run that validation again, so the resume warns that it is not exact and why, and never says exact.
    The batches still continue in order."""
    result = results["resume_point_every/step=4.ckpt"]
    assert result["resumed_batches"] == result["expected_batches"]
    lines = [line for line in result["lines"] if line.startswith("Resuming")]
    assert lines and all(line.startswith("Resuming not exactly") for line in lines), lines
    assert "validation" in lines[0]
