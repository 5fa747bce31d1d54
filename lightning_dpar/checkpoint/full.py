"""`checkpoint_format="full"`: one file that plain `torch.load` and `LightningModule.load_from_checkpoint` read.

Gathering a full state onto rank 0 is what this format is; it is opt-in (the sharded default never does). Optimizer
state is stored the way a plain `torch.optim` optimizer stores it: keyed by parameter position, not by name, so
`Trainer(strategy="auto").fit(ckpt_path=...)` on one device resumes from it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim import Optimizer

from lightning_dpar._private_api import local_shape_and_offset
from lightning_dpar.agreement import first_problem
from lightning_dpar.checkpoint.atomic import publish, remove_leftovers, with_per_rank
from lightning_dpar.checkpoint.contents import (
    DPAR_KEY,
    LoadReport,
    check_format_version,
    describe_problem,
    partial_name,
    read_with_remedy,
)
from lightning_dpar.checkpoint.errors import CheckpointLoadError, CheckpointSaveError
from lightning_dpar.checkpoint.mapped import MappedFile
from lightning_dpar.checkpoint.model_shaped import (
    distribute_like,
    gather_whole,
    holds_dtensors,
    keyed_like,
    model_shaped_entries,
)
from lightning_dpar.checkpoint.safe_io import safe_torch_load
from lightning_dpar.checkpoint.storage import Location

__all__ = [
    "full_model_state",
    "full_optimizer_state",
    "load_full",
    "names_to_positions",
    "positions_to_names",
    "read_full",
    "save_full",
]

_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state(model: nn.Module) -> dict[str, Any]:
    """The whole model on rank 0 (CPU); a collective, every rank must call it."""
    return get_model_state_dict(model, options=_GATHER)


def full_optimizer_state(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """The whole optimizer state on rank 0, keyed by parameter position like a plain optimizer's."""
    return names_to_positions(get_optimizer_state_dict(model, optimizer, options=_GATHER))


def names_to_positions(state: dict[str, Any]) -> dict[str, Any]:
    """FQN-keyed optimizer state (DCP's form) -> position-keyed (`torch.optim.Optimizer.state_dict()`'s form)."""
    if not state:  # ranks other than 0 receive nothing from a full gather
        return state
    position: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        ids = []
        for name in group["params"]:
            position.setdefault(name, len(position))
            ids.append(position[name])
        groups.append({**group, "params": ids})
    return {"state": {position[name]: value for name, value in state.get("state", {}).items()}, "param_groups": groups}


def positions_to_names(state: dict[str, Any], model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """Inverse of `names_to_positions` for this optimizer: position `i` is the `i`-th parameter of its groups."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    names = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    if not state.get("state") or isinstance(next(iter(state["state"])), str):
        return state
    groups, offset = [], 0
    for group in state["param_groups"]:
        groups.append({**group, "params": names[offset : offset + len(group["params"])]})
        offset += len(group["params"])
    return {"state": {names[i]: value for i, value in state["state"].items()}, "param_groups": groups}


def save_full(checkpoint: dict[str, Any], location: Location) -> None:
    """Write the file under a temporary name and publish it the way sharded checkpoints are published: readers
    never see half a file, and replacing `last.ckpt` never leaves no checkpoint at all. Rank 0 only."""
    location.parent.makedirs()
    remove_leftovers(location)
    partial = location.sibling(partial_name(location.name, uuid.uuid4().hex[:8]))
    try:
        partial.write_torch(checkpoint)
    except OSError:
        partial.remove()  # a full disk: give the space back, keep nothing partial
        raise
    publish(partial, location)


def read_full(location: Location) -> dict[str, Any]:
    """The whole checkpoint file, read with `weights_only=True` and memory-mapped when local, so each rank's memory
    holds only the tensors it touches (raises `CheckpointLoadError` naming the file if unusable)."""
    checkpoint = read_with_remedy(safe_torch_load, location)
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointLoadError(f"{location.url!r} is not a Lightning checkpoint: it holds no 'state_dict'.")
    check_format_version(checkpoint, location)
    return checkpoint


def load_full(
    checkpoint: dict[str, Any],
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    strict: bool,
    elsewhere: Callable[[str], bool] = lambda key: False,
    release: Callable[[torch.Tensor], None] = lambda tensor: None,
) -> LoadReport:
    """Every rank holds the file's content (`read_full`, memory-mapped) and keeps its own shards of model and
    optimizer state. Takes the model and optimizer states out of `checkpoint`, leaving Lightning's part of it. Keys
    for which `elsewhere` holds belong to parameters other ranks hold entirely (other pipeline stages): skipped.

    Memory: each rank copies its own block of every sharded tensor out of the mapped file, one tensor at a time, and
    then gives that tensor's mapped pages back (`release`, see `checkpoint.mapped`), so its resident set grows by its
    own shards and one tensor of the file, where torch's full-state-dict path scatters every whole tensor from rank
    0 (which then holds the whole file and a copy of it for the scatter)."""
    whole_state = checkpoint.pop("state_dict")
    model_state = {k: v for k, v in whole_state.items() if not elsewhere(k)}
    optimizer_states = checkpoint.pop("optimizer_states", [])
    if optimizers and len(model_state) != len(whole_state):
        raise CheckpointLoadError(
            "A full-format checkpoint keys its optimizer state by the position of each parameter in the unsplit"
            " model, which a pipeline stage cannot map to its own parameters. Resume pipelined runs from sharded"
            " checkpoints (`checkpoint_format='sharded'`, the default); `validate`/`test`/`predict` can load this file."
        )
    local = model.state_dict()  # this rank's shards (DTensors under FSDP / TP), no copies
    # Computed here: with `strict=False`, `set_model_state_dict` fills what is missing and reports nothing.
    report = LoadReport(missing=sorted(set(local) - set(model_state)), unexpected=sorted(set(model_state) - set(local)))
    if not all(_sliceable(value) for value in local.values()):  # e.g. strided FSDP x TP shards: torch's own path
        _load_through_scatter(model_state, optimizer_states, model, optimizers, strict)
        return report
    sharded = StateDictOptions(strict=strict)
    parts = {k: _local_part(v, local.get(k), release) for k, v in model_state.items()}
    set_model_state_dict(model, parts, options=sharded)
    del parts
    params = dict(model.named_parameters())
    for optimizer, state in zip(optimizers, optimizer_states):
        named = positions_to_names(state, model, optimizer)
        named["state"] = {
            fqn: {key: _local_part(value, params.get(fqn), release) for key, value in values.items()}
            for fqn, values in named.get("state", {}).items()
        }
        set_optimizer_state_dict(model, optimizer, named, options=sharded)
    return report


def _sliceable(value: Any) -> bool:
    """A local value whose block of the full tensor is a plain slice: not a DTensor, or sharded evenly by `Shard`
    and `Replicate` placements only."""
    return not isinstance(value, DTensor) or all(type(p) in (Shard, Replicate) for p in value.placements)


def _local_part(full: Any, like: Any, release: Callable[[torch.Tensor], None]) -> Any:
    """This rank's part of `full` shaped like `like` (a DTensor of the same global shape): a DTensor over a copy of
    its block of `full`, after which `full`'s mapped pages are given back; anything else unchanged."""
    if not isinstance(like, DTensor) or not isinstance(full, torch.Tensor) or full.shape != like.shape:
        return full
    shape, offset = local_shape_and_offset(full.shape, like.device_mesh, like.placements)
    block = full[tuple(slice(start, start + size) for size, start in zip(shape, offset))]
    block = block.to(like.device, copy=True)
    release(full)
    return DTensor.from_local(block, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())


def _load_through_scatter(
    model_state: dict[str, Any],
    optimizer_states: list[dict[str, Any]],
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    strict: bool,
) -> None:
    """torch's full-state-dict load: rank 0's copy of every tensor is scattered to the ranks."""
    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(model, model_state, options=options)
    for optimizer, state in zip(optimizers, optimizer_states):
        set_optimizer_state_dict(model, optimizer, positions_to_names(state, model, optimizer), options=options)


class FullFormat:
    """`checkpoint_format="full"`: one file, gathered to and written by rank 0; every rank reads it on load."""

    name = "full"

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        return full_model_state(model)

    def optimizer_state(self, model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
        return full_optimizer_state(model, optimizer)

    def save(
        self, checkpoint: dict[str, Any], record: dict[str, Any], per_rank: dict[str, Any], path: str, writer: Any
    ) -> None:
        """Rank 0 writes to its `path`; every rank raises the same `CheckpointSaveError` if that fails. Never in the
        background. `per_rank` is gathered to rank 0 first (the full state was just gathered there too)."""
        for container, key, _ in list(model_shaped_entries(checkpoint, holds_dtensors)):
            container[key] = gather_whole(container[key])  # averaged weights: gathered like the model
        problem = None
        gathered: list[Any] | None = [per_rank]
        if dist.is_initialized():
            gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(per_rank, gathered, dst=0)
        if gathered is not None:  # rank 0
            location = Location.parse(path)
            try:
                save_full({**checkpoint, DPAR_KEY: with_per_rank(record, gathered)}, location)
            except OSError as error:
                problem = (
                    f"Saving checkpoint {location.url!r} failed: rank 0 could not write it: {type(error).__name__}:"
                    f" {error}. Nothing was published under that name and the previous checkpoint is untouched; fix"
                    " the cause (free space, permissions) and save again."
                )
        problem = first_problem(problem)
        if problem is not None:
            raise CheckpointSaveError(problem)

    @staticmethod
    def open(location: Location, rank: int, world_size: int) -> FullSource:
        problem = describe_problem(location)
        if problem is not None:
            raise CheckpointLoadError(problem)
        checkpoint = read_full(location)
        return FullSource(checkpoint, MappedFile(location.path) if location.is_local else None)


class FullSource:
    """A full-format checkpoint, memory-mapped when local (every rank keeps only its shards once loaded)."""

    def __init__(self, checkpoint: dict[str, Any], mapped: MappedFile | None = None) -> None:
        self.checkpoint = checkpoint
        self.record: dict[str, Any] = checkpoint.pop(DPAR_KEY, {})
        self.rest = checkpoint
        self.mapped = mapped

    def load(
        self, model: nn.Module, optimizers: Sequence[Optimizer], strict: bool, elsewhere: Callable[[str], bool]
    ) -> LoadReport:
        release = self.mapped.release if self.mapped is not None else lambda tensor: None
        report = load_full(self.checkpoint, model, optimizers, strict, elsewhere, release)
        model_state = get_model_state_dict(model)
        places = list(model_shaped_entries(self.rest, keyed_like(set(model_state))))
        for container, key, _ in places:  # averaged or set-aside weights: laid out like the model
            container[key] = distribute_like(container[key], model_state)
        if places:
            self.rest["state_dict"] = model_state
        return report
