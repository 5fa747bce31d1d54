"""Sharded checkpoints with `torch.distributed.checkpoint` (DCP): the single owner of how state is saved and loaded.

Layout of a checkpoint directory (the same as Lightning's `ModelParallelStrategy`, so checkpoints move both ways):

- DCP files holding `state_dict` (the model, keyed by FQN relative to the LightningModule) and `optimizer_<i>`;
  each rank writes only its own shards, and loading reshards to whatever mesh the loader has;
- `meta.pt`: Lightning's non-tensor state (loops, callbacks, schedulers, hyperparameters), written by rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

METADATA_FILENAME = "meta.pt"
MODEL_KEY = "state_dict"


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / METADATA_FILENAME).is_file() and (path / ".metadata").is_file()


def sharded_model_state(model: nn.Module) -> dict[str, Any]:
    """The model's state as DTensor shards / local tensors; no rank gathers the full model."""
    return get_model_state_dict(model)


def sharded_optimizer_state(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """Optimizer state keyed by parameter FQN (not by position), so it survives a change of wrapper or mesh."""
    return get_optimizer_state_dict(model, optimizer)


def save_sharded(path: Path, checkpoint: dict[str, Any], is_global_zero: bool) -> None:
    """Write Lightning's `checkpoint` dict: tensors through DCP (every rank), the rest to `meta.pt` (rank 0)."""
    checkpoint = dict(checkpoint)
    tensor_state = {MODEL_KEY: checkpoint.pop("state_dict")}
    for index, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
        tensor_state[optimizer_key(index)] = optimizer_state
    path.mkdir(parents=True, exist_ok=True)
    dcp.save(tensor_state, checkpoint_id=path)
    if is_global_zero:
        torch.save(checkpoint, path / METADATA_FILENAME)


def load_sharded(path: Path, model: nn.Module, optimizers: Sequence[Optimizer], strict: bool) -> dict[str, Any]:
    """Load model and optimizer shards in place (resharding as needed) and return Lightning's remaining state."""
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(
            f"{str(path)!r} is not a lightning_dpar sharded checkpoint: expected a directory with DCP files and"
            f" {METADATA_FILENAME!r}."
        )
    options = StateDictOptions(strict=strict)
    state: dict[str, Any] = {MODEL_KEY: sharded_model_state(model)}
    for index, optimizer in enumerate(optimizers):
        state[optimizer_key(index)] = sharded_optimizer_state(model, optimizer)
    planner = dcp.DefaultLoadPlanner(allow_partial_load=not strict)
    dcp.load(state, checkpoint_id=path, planner=planner)
    set_model_state_dict(model, state[MODEL_KEY], options=options)
    for index, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, optimizer, state[optimizer_key(index)], options=options)
    return torch.load(path / METADATA_FILENAME, weights_only=False)
