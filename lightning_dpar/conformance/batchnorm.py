"""BatchNorm under the package's strategies: `Trainer(sync_batchnorm=True)`, and BatchNorm in pipeline stages.

`sync_batchnorm=True` converts every BatchNorm layer to `torch.nn.SyncBatchNorm` before the model is parallelised,
as Lightning's DDP does when fitting, with statistics synchronised over the data-parallel group only (tensor-parallel
peers hold the same rows). torch runs `SyncBatchNorm` only on GPU-like devices: on CPU Lightning's DDP fails at the
first training forward ("SyncBatchNorm expected input tensor to be on GPU"); here the flag is refused before the
process group starts, on every rank, with the same reason.

Pipeline stages run each batch as microbatches, so a BatchNorm layer would normalise over a microbatch instead of
the rank's batch and update its statistics once per microbatch: refused (`check_no_batch_norm_in_pipeline`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_dpar._private_api import privateuse1_backend_name
from lightning_dpar.helpers import class_name

__all__ = [
    "BATCH_NORM_TYPES",
    "batch_norm_layers",
    "check_no_batch_norm_in_pipeline",
    "check_sync_batchnorm_supported",
    "convert_sync_batchnorm",
]

#: The layers that normalise over the batch (and that `SyncBatchNorm.convert_sync_batchnorm` converts).
BATCH_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
    nn.SyncBatchNorm,
)


def batch_norm_layers(module: nn.Module) -> list[str]:
    """Names of the BatchNorm layers in `module` (`"<root>"` for the module itself)."""
    return [name or "<root>" for name, m in module.named_modules() if isinstance(m, BATCH_NORM_TYPES)]


def _sync_batchnorm_devices() -> tuple[str, ...]:
    # The device types `SyncBatchNorm.forward` accepts (torch checks the input's device in the same way).
    return ("cuda", "hpu", "xpu", privateuse1_backend_name())


def check_sync_batchnorm_supported(module: nn.Module, device: torch.device) -> None:
    """Refuse `Trainer(sync_batchnorm=True)` on a device where torch's `SyncBatchNorm` cannot run, if `module` has
    BatchNorm layers (without any, the flag changes nothing, as under DDP)."""
    layers = batch_norm_layers(module)
    if layers and device.type not in _sync_batchnorm_devices():
        raise ValueError(
            f"`Trainer(sync_batchnorm=True)` converts {layers} to `torch.nn.SyncBatchNorm`, which torch runs only on"
            f" {', '.join(_sync_batchnorm_devices())} devices, not on {device.type!r} (Lightning's DDP fails at the"
            " first training step with the same cause). Use `sync_batchnorm=False` (each rank normalises over its own"
            " batch, as DDP does), or train on GPUs."
        )


def convert_sync_batchnorm(module: nn.Module, group: dist.ProcessGroup | None) -> nn.Module:
    """Convert `module`'s BatchNorm layers in place to `SyncBatchNorm` over `group` (the data-parallel group)."""
    return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group=group)


def check_no_batch_norm_in_pipeline(module: nn.Module, pipeline_parallel_size: int) -> None:
    layers = batch_norm_layers(module)
    if layers:
        raise ValueError(
            f"{class_name(module)} has BatchNorm layers {layers}, and `pipeline_parallel_size="
            f"{pipeline_parallel_size}` runs each batch as microbatches: they would normalise over each microbatch"
            " and update their running statistics once per microbatch, not once over the rank's batch as under"
            " DDP. Use a per-sample normalisation (`nn.LayerNorm`, `nn.GroupNorm`), or `pipeline_parallel_size=1`."
        )
