"""Model and optimizer state as shards: what each rank hands to DCP on save, and loading shards back into a model
parallelised in any layout (DCP reshards: a checkpoint from `dpar_2d` on 4 ranks loads into `dpar_fsdp` on 1).

No rank ever gathers the full model or optimizer: the state dicts below hold DTensors / local tensors only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from lightning_dpar.checkpoint.contents import (
    DPAR_KEY,
    MODEL_KEY,
    CheckpointInfo,
    LoadReport,
    check_data_files,
    inspect_checkpoint,
    optimizer_key,
)
from lightning_dpar.checkpoint.errors import CheckpointLoadError
from lightning_dpar.checkpoint.model_shaped import SHARDED_ENTRY, keyed_like, marked_entries, model_shaped_entries
from lightning_dpar.checkpoint.safe_io import SafeLoadPlanner, safe_storage_reader, translate_dcp_errors
from lightning_dpar.checkpoint.storage import Location

__all__ = [
    "load_sharded",
    "sharded_model_state",
    "sharded_optimizer_state",
    "split_checkpoint",
]


def sharded_model_state(model: nn.Module) -> dict[str, Any]:
    """The model's state as DTensor shards / local tensors, keyed by FQN relative to the LightningModule."""
    return get_model_state_dict(model)


def sharded_optimizer_state(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """Optimizer state keyed by parameter FQN (not by position), so it survives a change of wrapper or mesh."""
    return get_optimizer_state_dict(model, optimizer)


def split_checkpoint(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lightning's checkpoint dict -> (tensor state for DCP, everything else for `meta.pt`)."""
    metadata = dict(checkpoint)
    model_state = metadata.pop("state_dict")
    tensor_state = {MODEL_KEY: model_state}
    for index, optimizer_state in enumerate(metadata.pop("optimizer_states", [])):
        tensor_state[optimizer_key(index)] = optimizer_state
    for container, key, dcp_key in list(model_shaped_entries(metadata, keyed_like(set(model_state)))):
        tensor_state[dcp_key] = container[key]  # averaged or set-aside weights: sharded like the model
        container[key] = {SHARDED_ENTRY: dcp_key}
    return tensor_state, metadata


def _shape_mismatches(info: CheckpointInfo, model_state: dict[str, Any]) -> list[str]:
    mismatches = []
    for key, value in model_state.items():
        stored = info.index.state_dict_metadata.get(f"{info.model_key}.{key}")
        if isinstance(stored, TensorStorageMetadata) and hasattr(value, "shape") and stored.size != value.shape:
            mismatches.append(f"{key}: checkpoint {tuple(stored.size)}, model {tuple(value.shape)}")
    return mismatches


def _format_keys(keys: Sequence[str], limit: int = 20) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def load_sharded(
    info: CheckpointInfo,
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    strict: bool,
    elsewhere: Callable[[str], bool] = lambda key: False,
    rest: dict[str, Any] | None = None,
) -> LoadReport:
    """Load model (and, if given, optimizer) shards from `info` into `model`/`optimizers` in place. Keys for which
    `elsewhere` holds belong to parameters other ranks hold entirely (other pipeline stages): they are skipped.
    States shaped like the model that `rest` (the checkpoint's `meta.pt` part) marks are read too, laid out like the
    model, into `rest` (`checkpoint.model_shaped`).

    Every check happens before the collective `dcp.load` and from the same index on every rank, so a bad
    checkpoint fails identically everywhere and never hangs.
    """
    url = info.location.url
    model_state = sharded_model_state(model)
    stored = {key for key in info.keys_under(info.model_key) if not elsewhere(key)}
    report = LoadReport(missing=sorted(set(model_state) - stored), unexpected=sorted(stored - set(model_state)))
    if not (set(model_state) & stored):
        raise CheckpointLoadError(
            f"{url!r} holds no parameter of this model: it has {_format_keys(sorted(stored))}, the model has"
            f" {_format_keys(sorted(model_state))}. It is a checkpoint of a different model."
        )
    if strict and (report.missing or report.unexpected):
        raise CheckpointLoadError(
            f"{url!r} does not match the model (strict loading). Missing in the checkpoint:"
            f" [{_format_keys(report.missing)}]; unexpected in the checkpoint: [{_format_keys(report.unexpected)}]."
            " Set `strict_loading = False` on the LightningModule to load the matching keys only."
        )
    mismatches = _shape_mismatches(info, model_state)
    if mismatches:
        raise CheckpointLoadError(
            f"{url!r} has parameters of other shapes than the model: {_format_keys(mismatches)}. It is a checkpoint"
            " of a differently configured model."
        )
    whole_model_state = model_state
    model_state = {k: v for k, v in model_state.items() if k in stored}
    state: dict[str, Any] = {info.model_key: model_state}
    places = list(marked_entries(rest)) if rest is not None else []
    for _, _, dcp_key in places:
        keys = info.keys_under(dcp_key) & set(whole_model_state)
        state[dcp_key] = {k: torch.empty_like(whole_model_state[k]) for k in sorted(keys)}
    for index, optimizer in enumerate(optimizers):
        key = optimizer_key(index)
        if not info.has_key(key):
            raise CheckpointLoadError(
                f"{url!r} holds no state for optimizer {index} ({type(optimizer).__name__}): it has the optimizers"
                f" {sorted(k for k in _top_keys(info) if k.startswith('optimizer_'))}. Was it saved with"
                " `save_weights_only=True`, or with other `configure_optimizers`? Load it with"
                " `validate`/`test`/`predict` or `lightning_dpar.load_from_checkpoint` instead of resuming `fit`."
            )
        optimizer_state = sharded_optimizer_state(model, optimizer)
        optimizer_state["state"] = {k: v for k, v in optimizer_state["state"].items() if k in stored}
        optimizer_state["param_groups"] = _groups_as_saved(info, key, optimizer_state["param_groups"])
        state[key] = optimizer_state
    with translate_dcp_errors(info.location):  # DCP's CheckpointException is a BaseException
        dcp.load(
            state,
            storage_reader=safe_storage_reader(info.location, info.index),
            planner=SafeLoadPlanner(allow_partial_load=not strict),
        )
    options = StateDictOptions(strict=strict)
    set_model_state_dict(model, state[info.model_key], options=options)
    for index, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, optimizer, state[optimizer_key(index)], options=options)
    if places:
        assert rest is not None
        for container, key, dcp_key in places:
            container[key] = state[dcp_key]
        rest["state_dict"] = model_state
    return report


def _groups_as_saved(info: CheckpointInfo, key: str, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The optimizer's param groups with the settings the checkpoint saved for them, no more, no fewer: what
    `Optimizer.load_state_dict` restores (it replaces each group by the saved one). A setting added since the save,
    such as the `initial_lr` of a scheduler made after it (the `Tuner`'s `lr_find` does that), is dropped; one
    saved but missing now is loaded. DCP stores each group's settings as `<key>.param_groups.<i>.<name>`."""
    saved: dict[int, set[str]] = {}
    for name in info.keys_under(f"{key}.param_groups"):
        index, _, setting = name.partition(".")
        if index.isdigit() and setting:
            saved.setdefault(int(index), set()).add(setting)
    if not saved:
        return groups
    return [{name: group.get(name) for name in saved.get(i, group.keys())} for i, group in enumerate(groups)]


def _top_keys(info: CheckpointInfo) -> set[str]:
    return {k.split(".", 1)[0] for k in info.index.state_dict_metadata}


class ShardedFormat:
    """`checkpoint_format="sharded"`: a DCP directory; every rank writes and reads only its own shards."""

    name = "sharded"

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        return sharded_model_state(model)

    def optimizer_state(self, model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
        return sharded_optimizer_state(model, optimizer)

    def save(
        self, checkpoint: dict[str, Any], record: dict[str, Any], per_rank: dict[str, Any], path: str, writer: Any
    ) -> None:
        """`per_rank` rides on the writer's finishing collective to rank 0, which writes `meta.pt`."""
        tensor_state, metadata = split_checkpoint(checkpoint)
        metadata[DPAR_KEY] = record
        writer.save(tensor_state, metadata, path, per_rank)

    @staticmethod
    def open(location: Location, rank: int, world_size: int) -> ShardedSource:
        """Validate the directory; this rank checks its share of the data files (raises `CheckpointLoadError`)."""
        info = inspect_checkpoint(location)
        problem = check_data_files(info, rank, world_size)
        if problem is not None:
            raise CheckpointLoadError(problem)
        return ShardedSource(info)


class ShardedSource:
    """A validated sharded checkpoint, ready to load into a model parallelised in any layout."""

    def __init__(self, info: CheckpointInfo) -> None:
        self.info = info
        self.record: dict[str, Any] = info.dpar_record
        self.rest: dict[str, Any] = {k: v for k, v in info.metadata.items() if k != DPAR_KEY}

    def load(
        self, model: nn.Module, optimizers: Sequence[Optimizer], strict: bool, elsewhere: Callable[[str], bool]
    ) -> LoadReport:
        return load_sharded(self.info, model, optimizers, strict, elsewhere, self.rest)
