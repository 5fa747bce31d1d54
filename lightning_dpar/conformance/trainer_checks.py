"""Trainer and LightningModule settings a parallel layout cannot run, refused before the process group exists (so
they fail identically on every rank, never in a collective): manual optimisation under pipeline parallelism, and
`Trainer(detect_anomaly=True)` under tensor parallelism. Callbacks are checked in
`lightning_dpar.conformance.callback_checks`."""

from __future__ import annotations

from typing import Any

from lightning_dpar._private_api import detect_anomaly_requested
from lightning_dpar.helpers import class_name

__all__ = ["check_anomaly_detection", "check_pipeline_optimization"]


def check_pipeline_optimization(module: Any, pipeline_parallel_size: int) -> None:
    """Manual optimisation cannot be pipelined: the schedule runs each microbatch's forward and backward itself."""
    if module is not None and not module.automatic_optimization:
        raise ValueError(
            f"{class_name(module)} sets `automatic_optimization = False`, and `pipeline_parallel_size="
            f"{pipeline_parallel_size}` runs `training_step` through a pipeline schedule that"
            " does each microbatch's forward and backward itself, so `manual_backward` and your own optimizer"
            " steps cannot run inside it. Use automatic optimisation, or `pipeline_parallel_size=1`."
        )


def check_anomaly_detection(trainer: Any, tensor_parallel_size: int) -> None:
    """`Trainer(detect_anomaly=True)` with tensor parallelism: torch's anomaly mode checks every gradient with an
    operator DTensor has no sharding rule for, so the first backward would fail on every rank."""
    if tensor_parallel_size > 1 and detect_anomaly_requested(trainer):
        raise ValueError(
            f"`Trainer(detect_anomaly=True)` cannot run with `tensor_parallel_size={tensor_parallel_size}`: torch's"
            " anomaly mode checks each gradient with `aten._is_any_true`, which tensor-parallel (DTensor)"
            " gradients do not support. Use `detect_anomaly=False`, or look for the anomaly with"
            " `tensor_parallel_size=1` (e.g. `strategy='dpar_fsdp'`)."
        )
