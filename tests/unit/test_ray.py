"""`lightning_dpar.ray.prepare_trainer`'s refusals, in process (no Ray cluster; skipped without `ray`). The runs on
Ray workers are in `tests/launched/test_ray_train.py` (workers in `tests/workers/ray_train.py`)."""

from __future__ import annotations

import lightning as L
import pytest


def test_prepare_trainer_refuses_what_cannot_run_under_ray():
    """Checked before anything asks Ray for the worker group (a Trainer with Ray's environment exists only in one)."""
    pytest.importorskip("ray")
    from lightning_dpar.ray import prepare_trainer

    ddp = L.Trainer(accelerator="cpu", devices=1, strategy="ddp", logger=False)
    with pytest.raises(TypeError, match=r"prepares the lightning_dpar strategies, not DDPStrategy"):
        prepare_trainer(ddp)
    outside = L.Trainer(accelerator="cpu", devices=1, strategy="dpar_fsdp", logger=False)
    with pytest.raises(
        TypeError, match=r"environment is LightningEnvironment; under Ray Train it must be .*RayLightningEnvironment"
    ):
        prepare_trainer(outside)
