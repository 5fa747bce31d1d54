"""Reading a checkpoint without running code from it, and errors that name the file and say what to do.

Three things in a sharded checkpoint are pickles: our `meta.pt` (Lightning's loops, callbacks, hyperparameters),
DCP's `.metadata` index, and DCP's non-tensor leaves in the `.distcp` files (e.g. an optimizer's `lr`); a full-format
checkpoint is one `torch.save` file. Unpickling runs whatever callables a pickle names, so:

- `meta.pt`, full-format files and the non-tensor leaves are read with `torch.load(weights_only=True)` (torch's own
  allowlist of tensors, containers and primitive types; local files memory-mapped);
- the `.metadata` index, which DCP itself reads with a plain `pickle.load`, is read here by an unpickler that builds
  only the exact (module, name) pairs a DCP index consists of (`INDEX_GLOBALS`): no dotted names, no functions, no
  whole modules.

A refusal is an `UnsafeCheckpointError` naming the file and what it refers to. A checkpoint whose `meta.pt` holds a
type of the user's own (a dataclass hyperparameter, an enum) needs it allowed once, before loading:
`torch.serialization.add_safe_globals([MyConfig])`. The index never holds user types, so it has nothing to allow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pathlib
import pickle
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from lightning_dpar._private_api import FsspecReader
from lightning_dpar.checkpoint.errors import (  # the load errors, importable from here as documented before
    CheckpointLoadError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    describe_dcp_failures,
)
from lightning_dpar.checkpoint.storage import Location

__all__ = [
    "INDEX_CLASSES",
    "SafeLoadPlanner",
    "load_bytes_item",
    "read_dcp_index",
    "safe_storage_reader",
    "safe_torch_load",
    "translate_dcp_errors",
    "weights_only_refusal",
]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"

#: Every class a DCP `.metadata` index refers to, as the exact (module, name) pickle writes. Derived by pickling the
#: indexes `dcp.save` / `dcp.async_save` write (FSDP2 DTensor shards, TP+FSDP 2D shards, plain tensors of every
#: dtype, bytes leaves, optimizer states of Adam/AdamW/SGD; `FileSystemWriter` with one or several files per rank,
#: `checkpoint_id` as `str`, `pathlib.Path` and `file://` URL through the fsspec writer) and listing their globals.
#: `_MEM_FORMAT_ENCODING` (the enum `TensorProperties` pickles its memory format as) and `_StorageInfo` (where each
#: item's bytes lie in the `.distcp` files) are private DCP classes: pickle names them, so the index does.
INDEX_CLASSES: frozenset[tuple[str, str]] = frozenset(
    {
        (_DCP_METADATA, "Metadata"),
        (_DCP_METADATA, "MetadataIndex"),
        (_DCP_METADATA, "StorageMeta"),
        (_DCP_METADATA, "TensorStorageMetadata"),
        (_DCP_METADATA, "BytesStorageMetadata"),
        (_DCP_METADATA, "ChunkStorageMetadata"),
        (_DCP_METADATA, "TensorProperties"),
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),  # `StorageMeta.checkpoint_id` of a save given a `pathlib.Path`
    }
)
#: Values an index names that are not classes of this Python: dtypes pickle as `torch.<name>`; a `WindowsPath`
#: (written on Windows) is read as the pure path, which every OS can build; Python 3.13 pickles paths as
#: `pathlib._local.*` (CPython gh-133789), a module older and newer Pythons lack or only re-export.
_INDEX_VALUES: dict[tuple[str, str], Any] = {
    **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib._local", "PosixPath"): pathlib.PosixPath,
    ("pathlib._local", "WindowsPath"): pathlib.PureWindowsPath,
}
#: Layouts (`TensorProperties.layout`) pickle as a call `torch.serialization._get_layout("torch.strided")`; instead of
#: that function the index gets one of ours that only maps the names of torch's layouts to the layouts.
_LAYOUT_FUNCTION = ("torch.serialization", "_get_layout")
_LAYOUTS: dict[str, torch.layout] = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


class _RefusedGlobal(pickle.UnpicklingError):
    def __init__(self, qualified_name: str) -> None:
        super().__init__(qualified_name)
        self.qualified_name = qualified_name


def _layout_named(name: Any) -> torch.layout:
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"{name!r} is not a torch layout")
    return _LAYOUTS[name]


class _DCPIndexUnpickler(pickle.Unpickler):
    """Builds only what `INDEX_CLASSES`, the dtypes and layouts name: a crafted index can refer to nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:  # protocol 4 resolves "a.b" through module attributes: never admitted
            if (module, name) in INDEX_CLASSES:
                return super().find_class(module, name)
            if (module, name) in _INDEX_VALUES:
                return _INDEX_VALUES[(module, name)]
            if (module, name) == _LAYOUT_FUNCTION:
                return _layout_named
        raise _RefusedGlobal(f"{module}.{name}")


def _refusal(url: str, refers_to: str) -> str:
    return (
        f"{url!r} refers to {refers_to}, which a DCP index never contains: the file was not written by"
        " torch.distributed.checkpoint, or was altered to run code when loaded. Nothing from it was run. Do not use"
        " this checkpoint; load another one. (An index holds only DCP's own metadata classes, so there is nothing to"
        " allow: types of your own belong in `meta.pt`, allowed with `torch.serialization.add_safe_globals`.)"
    )


def read_dcp_index(location: Location) -> Metadata:
    """DCP's `.metadata` of the checkpoint at `location`, unpickled with the exact allowlist `INDEX_CLASSES`."""
    index = location.child(".metadata")
    try:
        with index.open("rb") as f:
            metadata = _DCPIndexUnpickler(io.BytesIO(f.read())).load()
    except _RefusedGlobal as refused:
        raise UnsafeCheckpointError(_refusal(index.url, refused.qualified_name)) from None
    except Exception as error:  # truncated or garbled data fails in many ways (EOF, bad opcode, bad arguments)
        raise CorruptCheckpointError(
            f"{index.url!r} cannot be read as a DCP index ({type(error).__name__}: {error}): the file is truncated"
            " or corrupted."
        ) from error
    _check_index_content(metadata, index.url)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def _check_index_content(metadata: Any, url: str) -> None:
    """The classes are DCP's; check the shape too, so a crafted index cannot point readers outside the directory."""
    problem = None
    if not isinstance(metadata, Metadata):
        problem = f"holds a {type(metadata).__name__}, not a DCP index"
    elif not isinstance(metadata.state_dict_metadata, dict) or not all(
        isinstance(v, (TensorStorageMetadata, BytesStorageMetadata)) for v in metadata.state_dict_metadata.values()
    ):
        problem = "has entries that are neither tensors nor bytes"
    else:
        for storage in (metadata.storage_data or {}).values():
            name = getattr(storage, "relative_path", None)
            if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
                problem = f"points at the data file {name!r}, outside the checkpoint directory"
                break
    if problem is not None:
        raise CorruptCheckpointError(f"{url!r} {problem}; it was not written by torch.distributed.checkpoint.")


def _unsafe_globals(source: str | io.BytesIO) -> list[str]:
    """The globals a `torch.save` file names that `weights_only` does not allow (a static scan: runs nothing)."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(source)
    except Exception:
        return []


def weights_only_refusal(what: str, error: pickle.UnpicklingError, unsafe: list[str]) -> str:
    """The message for content `torch.load(weights_only=True)` refused; `what` names the file (and item)."""
    named = re.findall(r"GLOBAL ([\w.]+)", str(error))
    refers_to = ", ".join(unsafe or named) or str(error).strip().splitlines()[-1]
    return (
        f"{what} refers to {refers_to}, which `torch.load(weights_only=True)` does not load: loading it could run"
        " code. Nothing from it was run. If this is a type of your own (a hyperparameter class, an enum) and you"
        " trust the checkpoint, allow it before loading: `torch.serialization.add_safe_globals([YourType])`."
        " Functions and modules (e.g. os.system, builtins.eval) are never types of yours: do not use this checkpoint."
    )


def safe_torch_load(location: Location) -> Any:
    """`torch.load(weights_only=True)` of one file, memory-mapped when local (tensors are read only when touched).

    Raises `UnsafeCheckpointError` for content that would run code, `CorruptCheckpointError` for anything else
    unreadable; both name the file.
    """
    try:
        if location.is_local:
            with open(location.path, "rb") as f:
                head = f.read(4)
            source: str | io.BytesIO = location.path
        else:  # remote (fsspec): no mmap; read once into memory
            with location.open("rb") as f:
                source = io.BytesIO(f.read())
            head = source.getvalue()[:4]
    except OSError as error:
        raise CorruptCheckpointError(f"{location.url!r} cannot be opened: {error}.") from error
    if head != b"PK\x03\x04":  # torch.save writes a zip archive
        what = (
            "a plain pickle, which is never loaded (unpickling it could run code)"
            if head[:1] == b"\x80"
            else f"not written by `torch.save` (or is truncated to {location.size()} bytes)"
        )
        raise CheckpointLoadError(
            f"{location.url!r} is not a checkpoint: it is {what}. Pass a checkpoint file written by"
            " `Trainer.save_checkpoint` (`checkpoint_format='full'`) or a sharded checkpoint directory."
        )
    try:
        return torch.load(source, map_location="cpu", weights_only=True, mmap=location.is_local)
    except pickle.UnpicklingError as error:
        if isinstance(source, io.BytesIO):
            source.seek(0)
        raise UnsafeCheckpointError(weights_only_refusal(repr(location.url), error, _unsafe_globals(source))) from None
    except Exception as error:
        raise CorruptCheckpointError(
            f"{location.url!r} cannot be read ({type(error).__name__}: {_first_sentence(error)}): the file is"
            " truncated or corrupted."
        ) from error


def _first_sentence(error: BaseException) -> str:
    """torch's reader errors go on with generic advice after the first sentence; the cause is in the first."""
    return str(error).strip().splitlines()[0].split(". ")[0].rstrip(".")


def load_bytes_item(data: bytes, what: str) -> Any:
    """A DCP non-tensor leaf (`torch.save` bytes), loaded `weights_only`; `what` names file and item for errors."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(weights_only_refusal(what, error, _unsafe_globals(io.BytesIO(data)))) from None
    except Exception as error:
        raise CorruptCheckpointError(
            f"{what} cannot be read ({type(error).__name__}: {_first_sentence(error)}): the file is truncated or"
            " corrupted."
        ) from error


def safe_storage_reader(location: Location, index: Metadata | None = None) -> FileSystemReader:
    """DCP reader for `location` whose index is read by `read_dcp_index` instead of `pickle.load`; pass the `index`
    already read (`CheckpointInfo.index`) so DCP does not read and parse it again. It reads one data file at a time,
    so a failure names the file."""
    base = FileSystemReader if location.is_local else FsspecReader

    class _SafeReader(base):  # type: ignore[misc, valid-type]
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            metadata = index if index is not None else read_dcp_index(location)
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
            per_file: dict[str, list[ReadItem]] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            for name, items in per_file.items():
                file = location.child(name).url
                try:
                    super().read_data(dataclasses.replace(plan, items=items), planner).wait()
                except CheckpointLoadError as error:
                    raise type(error)(f"In {file!r}: {error}") from None
                except pickle.UnpicklingError as error:  # DCP reads tensor items `weights_only` itself
                    raise UnsafeCheckpointError(
                        weights_only_refusal(f"In {file!r}: a tensor item", error, [])
                    ) from None
                except Exception as error:
                    raise CorruptCheckpointError(
                        f"{file!r} cannot be read ({type(error).__name__}: {_first_sentence(error)}): the file is"
                        " truncated or corrupted."
                    ) from error
            return _done()

    return _SafeReader(location.url)


def _done() -> torch.futures.Future[None]:
    future: torch.futures.Future[None] = torch.futures.Future()
    future.set_result(None)
    return future


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor leaves (optimizer hyperparameters) load with `weights_only=True`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = load_bytes_item(value.getvalue(), f"the non-tensor item {read_item.dest_index.fqn!r}")
        super().load_bytes(read_item, _Preloaded(loaded))  # type: ignore[arg-type]


class _Preloaded(io.BytesIO):
    """Hands an already safely-loaded object through `DefaultLoadPlanner.load_bytes`'s `torch.load`."""

    def __init__(self, obj: Any) -> None:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        super().__init__(buffer.getvalue())


@contextlib.contextmanager
def translate_dcp_errors(
    location: Location, action: str = "load", error_type: type[Exception] = CheckpointLoadError
) -> Iterator[None]:
    """Around `dcp.load` / `dcp.save` (and an async save's `.result()`): DCP's `CheckpointException` (a
    `BaseException`, which `except Exception` misses) becomes `error_type` naming the checkpoint and each failing
    rank's cause; an `UnpicklingError` that escapes DCP becomes an `UnsafeCheckpointError` naming the checkpoint.

    A rank's cause is already a `CheckpointLoadError` naming its file when the reader is `safe_storage_reader`; a
    single cause shared by every rank is reported once. An `UnsafeCheckpointError` / `CorruptCheckpointError` cause
    keeps its type when `error_type` is `CheckpointLoadError`.
    """
    try:
        yield
    except CheckpointException as error:
        kinds = {type(cause) for cause, _trace in error.failures.values()}
        described = describe_dcp_failures(error)
        kind = error_type
        if error_type is CheckpointLoadError and len(kinds) == 1 and issubclass(next(iter(kinds)), CheckpointLoadError):
            kind = next(iter(kinds))
        raise kind(f"Checkpoint {action} of {location.url!r} failed on {described}") from None
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(weights_only_refusal(f"Checkpoint {location.url!r}", error, [])) from None
