"""Reading a sharded checkpoint in one process, without a process group: the basis of `consolidate` and of
`load_from_checkpoint`. DCP assembles each tensor from whichever ranks' files hold its pieces.

`read_tensor` reads one tensor at a time (only the byte ranges it needs), so a caller that writes each tensor out
before reading the next (the safetensors export) never holds more than one tensor of the model.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from lightning_dpar.checkpoint.contents import (
    DCP_INDEX_FILENAME,
    DPAR_KEY,
    METADATA_FILENAME,
    CheckpointInfo,
    check_data_files,
    inspect_checkpoint,
    optimizer_key,
)
from lightning_dpar.checkpoint.errors import CheckpointLoadError
from lightning_dpar.checkpoint.full import names_to_positions
from lightning_dpar.checkpoint.safe_io import (
    SafeLoadPlanner,
    safe_storage_reader,
    translate_dcp_errors,
)
from lightning_dpar.checkpoint.storage import Location

__all__ = [
    "OfflineCheckpoint",
]


class OfflineCheckpoint:
    """A validated sharded checkpoint opened for reading in this process."""

    def __init__(self, path: str) -> None:
        location = Location.parse(path)
        if not location.is_dir():
            raise CheckpointLoadError(_not_a_directory(location))
        self.info: CheckpointInfo = inspect_checkpoint(location)
        problem = check_data_files(self.info, rank=0, world_size=1)
        if problem is not None:
            raise CheckpointLoadError(problem)

    def _entries(self, top_key: str) -> dict[str, Any]:
        prefix = f"{top_key}."
        return {k: v for k, v in self.info.index.state_dict_metadata.items() if k.startswith(prefix)}

    def model_tensors(self) -> dict[str, TensorStorageMetadata]:
        """The model's tensors as the index describes them (name relative to the LightningModule -> shape/dtype)."""
        prefix = len(self.info.model_key) + 1
        return {
            k[prefix:]: v for k, v in self._entries(self.info.model_key).items() if isinstance(v, TensorStorageMetadata)
        }

    def read_tensor(self, name: str) -> torch.Tensor:
        """One model tensor, assembled in full from every rank's shards."""
        key = f"{self.info.model_key}.{name}"
        return self._read({key: self.info.index.state_dict_metadata[key]})[self.info.model_key][name]

    def iter_model(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.model_tensors():
            yield name, self.read_tensor(name)

    def _read(self, entries: dict[str, Any]) -> dict[str, Any]:
        """Load the given index entries into a nested state dict shaped as it was saved."""
        flat: dict[str, Any] = {}
        for key, meta in entries.items():
            if isinstance(meta, TensorStorageMetadata):
                flat[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
            elif isinstance(meta, BytesStorageMetadata):
                flat[key] = ""  # placeholder, replaced by the stored value
        state = _unflatten(flat, self.info.index.planner_data or {})
        with translate_dcp_errors(self.info.location), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process is the point
            reader = safe_storage_reader(self.info.location, self.info.index)
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
        return state

    def optimizer_states(self) -> list[dict[str, Any]]:
        """Every optimizer's full state, keyed by parameter position the way a plain `torch.optim` optimizer is."""
        states = []
        index = 0
        while entries := self._entries(optimizer_key(index)):
            states.append(names_to_positions(self._read(entries)[optimizer_key(index)]))
            index += 1
        return states

    def lightning_checkpoint(self, with_optimizers: bool = True) -> dict[str, Any]:
        """A single-file Lightning checkpoint: `state_dict`, `optimizer_states` and the rest of `meta.pt`."""
        checkpoint = {k: v for k, v in self.info.metadata.items() if k != DPAR_KEY}
        model_key = self.info.model_key
        tensors = {f"{model_key}.{name}": meta for name, meta in self.model_tensors().items()}
        checkpoint["state_dict"] = self._read(tensors)[model_key]  # one read: this format holds it all anyway
        if with_optimizers:
            checkpoint["optimizer_states"] = self.optimizer_states()
        return checkpoint


def _not_a_directory(location: Location) -> str:
    expected = f"expected a sharded checkpoint directory (the DCP index {DCP_INDEX_FILENAME!r}, `__<rank>_<i>.distcp`"
    expected += f" data files and {METADATA_FILENAME!r})"
    if not location.exists():
        return f"Checkpoint path {location.url!r} does not exist, {expected}."
    with location.open("rb") as f:
        is_torch_file = f.read(4) == b"PK\x03\x04"
    if is_torch_file:
        return (
            f"{location.url!r} is a single checkpoint file (the full format, or already consolidated), {expected}."
            " A single file needs no consolidation: load it with `torch.load(path, weights_only=True)` or"
            " `LightningModule.load_from_checkpoint`."
        )
    return f"{location.url!r} is a file that is not a checkpoint, {expected}."


def _unflatten(flat: dict[str, Any], mappings: dict[str, tuple]) -> dict[str, Any]:
    """Undo DCP's flattening with the key paths it recorded in the index (`planner_data`)."""
    root: dict[str, Any] = {}
    for key, value in flat.items():
        path = mappings.get(key, tuple(key.split(".")))
        node: Any = root
        for part, following in itertools.pairwise(path):
            container = [] if isinstance(following, int) else {}
            if isinstance(node, list):
                while len(node) <= part:
                    node.append(None)
                if node[part] is None:
                    node[part] = container
                node = node[part]
            else:
                node = node.setdefault(part, container)
        last = path[-1]
        if isinstance(node, list):
            while len(node) <= last:
                node.append(None)
        node[last] = value
    return root
