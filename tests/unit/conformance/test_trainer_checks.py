"""Trainer and LightningModule settings a layout cannot run (`lightning_dpar.conformance.trainer_checks`), refused
before any process group with the bad value and the fix named."""

from __future__ import annotations

import lightning as L
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_dpar.conformance.trainer_checks import check_anomaly_detection, check_pipeline_optimization

QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False, "enable_checkpointing": False}


class ManualModel(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


def test_manual_optimisation_is_refused_only_under_pipeline_parallelism():
    check_pipeline_optimization(BoringModel(), 2)
    check_pipeline_optimization(None, 2)  # no module yet
    with pytest.raises(
        ValueError,
        match=r"test_trainer_checks\.ManualModel sets `automatic_optimization = False`, and"
        r" `pipeline_parallel_size=4`",
    ):
        check_pipeline_optimization(ManualModel(), 4)


def test_anomaly_detection_is_refused_only_with_tensor_parallelism():
    anomaly = L.Trainer(accelerator="cpu", devices=1, detect_anomaly=True, **QUIET)
    check_anomaly_detection(anomaly, 1)
    check_anomaly_detection(L.Trainer(accelerator="cpu", devices=1, **QUIET), 4)
    with pytest.raises(ValueError, match=r"cannot run with `tensor_parallel_size=2`.*`detect_anomaly=False`"):
        check_anomaly_detection(anomaly, 2)
