"""Reading a checkpoint without running pickled code from it.

Three things in a sharded checkpoint are pickles: our `meta.pt` (Lightning's loops, callbacks, hyperparameters),
DCP's `.metadata` index, and DCP's non-tensor leaves (e.g. an optimizer's `lr`). `torch.load(weights_only=True)`
covers `meta.pt` and the leaves; `.metadata` is a plain pickle that DCP itself reads with `pickle.load`, so it is
read here with an unpickler that only builds the classes a DCP index consists of.

A checkpoint whose metadata holds types of the user's own (a dataclass hyperparameter, an enum) needs them allowed
once, before loading: `torch.serialization.add_safe_globals([MyConfig])`.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from lightning_dpar._private_api import FsspecReader
from lightning_dpar.checkpoint.storage import Location

__all__ = [
    "CheckpointLoadError",
    "SafeLoadPlanner",
    "read_dcp_index",
    "safe_storage_reader",
    "safe_torch_load",
]

#: Modules whose classes make up a DCP `.metadata` index (dataclasses and torch's dtype/Size/layout singletons).
_DCP_INDEX_MODULES = ("torch.distributed.checkpoint.", "torch.distributed._shard.")
_TORCH_SCALARS = {"Size", "strided", "sparse_coo", "contiguous_format", "preserve_format", "channels_last"}
_BUILTINS = {"set", "frozenset", "slice", "tuple", "list", "dict", "int", "float", "bool", "str", "bytes"}
#: Other globals an index refers to: layouts are pickled by name; the writer's path may be a `pathlib` path.
_OTHER_GLOBALS = {
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class CheckpointLoadError(RuntimeError):
    """A checkpoint cannot be loaded; the message names the path, the problem and what to do."""


class _DCPIndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module.startswith(_DCP_INDEX_MODULES)
            or (module == "torch" and (name in _TORCH_SCALARS or isinstance(getattr(torch, name, None), torch.dtype)))
            or (module == "builtins" and name in _BUILTINS)
            or (module, name) in _OTHER_GLOBALS
        )
        if not allowed:
            raise pickle.UnpicklingError(f"the DCP index refers to {module}.{name}, which an index never contains")
        return super().find_class(module, name)


def read_dcp_index(location: Location) -> Metadata:
    """DCP's `.metadata` of the checkpoint at `location`, unpickled with an allowlist of DCP's own classes."""
    index = location.child(".metadata")
    try:
        with index.open("rb") as f:
            metadata = _DCPIndexUnpickler(io.BytesIO(f.read())).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as error:
        raise CheckpointLoadError(
            f"{index.url!r} is not a readable DCP index ({error}). The checkpoint is corrupted or was not written by"
            " torch.distributed.checkpoint; use another checkpoint."
        ) from error
    if not isinstance(metadata, Metadata):
        raise CheckpointLoadError(f"{index.url!r} holds a {type(metadata).__name__}, not a DCP index.")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def safe_torch_load(location: Location) -> Any:
    """`torch.load(weights_only=True)` of one file, with an error that says how to allow a user's own types."""
    with location.open("rb") as f:
        data = f.read()
    if not data.startswith(b"PK"):  # torch.save writes a zip archive
        raise CheckpointLoadError(
            f"{location.url!r} is not a checkpoint: it was not written by `torch.save` (or is truncated to"
            f" {len(data)} bytes). Pass a checkpoint file or a sharded checkpoint directory."
        )
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointLoadError(
            f"{location.url!r} holds a type that `torch.load(weights_only=True)` does not load by default:\n{error}\n"
            "Checkpoints are never unpickled with arbitrary code. If the type is your own (for example a"
            " hyperparameter class) and you trust this checkpoint, allow it before loading:"
            " `torch.serialization.add_safe_globals([YourType])`."
        ) from error
    except (RuntimeError, EOFError, OSError) as error:
        raise CheckpointLoadError(
            f"{location.url!r} cannot be read ({error}); the file is truncated or corrupted."
        ) from error


def safe_storage_reader(location: Location, index: Metadata | None = None) -> FileSystemReader:
    """DCP reader for `location` whose index is read by `read_dcp_index` instead of `pickle.load`; pass the `index`
    already read (`CheckpointInfo.index`) so DCP does not read and parse it again."""
    base = FileSystemReader if location.is_local else FsspecReader

    class _SafeReader(base):  # type: ignore[misc, valid-type]
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            metadata = index if index is not None else read_dcp_index(location)
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _SafeReader(location.url)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor leaves (optimizer hyperparameters) load with `weights_only=True`."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        super().load_bytes(read_item, _Preloaded(loaded))  # type: ignore[arg-type]


class _Preloaded(io.BytesIO):
    """Hands an already safely-loaded object through `DefaultLoadPlanner.load_bytes`'s `torch.load`."""

    def __init__(self, obj: Any) -> None:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        super().__init__(buffer.getvalue())
