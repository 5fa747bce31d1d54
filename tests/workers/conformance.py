"""Cases of `tests/test_conformance.py`: the Trainer flags, buffers and the Tuner rows of the Lightning conformance
matrix, each run under every strategy column and Lightning's DDP (`tests/conformance_harness.py`)."""

from __future__ import annotations

from typing import Any

from tests.conformance_harness import BATCH, Column, column_groups, conformance_module, conformance_trainer, fingerprint
from tests.models import RegressionData, loader


def train_and_validate(strategy: Any, column: Column) -> Any:
    """Buffers: BatchNorm's running statistics after training on different batches per rank, and validation with
    them (every 2 steps); the logged values show whether every rank evaluated with the same statistics."""
    module = conformance_module(column)
    trainer = conformance_trainer(strategy, column, val_check_interval=2, limit_val_batches=2)
    trainer.fit(module, loader(RegressionData(64), BATCH), loader(RegressionData(32, seed=5), BATCH))
    return fingerprint(trainer)


FEATURES = {
    "buffers": train_and_validate,
}

GROUPS = column_groups("conformance", FEATURES)
