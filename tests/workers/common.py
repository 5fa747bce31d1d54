"""Helpers shared by the multi-process test workers."""

from __future__ import annotations

import os

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

BATCH = 4
STEPS = 3


def world_size() -> int:
    return int(os.environ["WORLD_SIZE"])


def full_params(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters on rank 0 (of every pipeline stage); a collective, so every rank must call it."""
    dims = getattr(trainer.strategy, "dims", None)
    if dims is not None and dims.pipeline > 1:
        # Each stage gathers its own shards; then the stages exchange their parts.
        state = get_model_state_dict(trainer.lightning_module, options=StateDictOptions(full_state_dict=True))
        parts = [None] * world_size()
        dist.all_gather_object(parts, {k: v.detach().cpu() for k, v in state.items()})
        return {k: v for part in parts for k, v in part.items()}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(trainer.lightning_module, options=options)


def trainer_for(strategy, max_steps: int = STEPS, devices: int | None = None, **kwargs) -> L.Trainer:
    """A quiet Trainer on `devices` ranks (default: the launch's world): no logger, checkpointing, progress bar or
    sanity check (each can be switched back on through `kwargs`)."""
    defaults = dict(
        accelerator=os.environ.get("DPAR_TEST_ACCELERATOR", "cpu"),  # "cuda" for the GPU-marked tests
        devices=devices if devices is not None else world_size(),
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)
