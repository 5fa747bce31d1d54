"""What a checkpoint directory contains, how to recognise each kind, and how to tell a user what is wrong with one.

A sharded checkpoint (the default format) is a directory:

- DCP data files (`__<rank>_<i>.distcp`) and DCP's index `.metadata`, holding the model under `state_dict` and each
  optimizer under `optimizer_<i>`, every rank writing only its shards (the files and keys Lightning's
  `ModelParallelStrategy` writes, so checkpoints move both ways; `FSDPStrategy(state_dict_type="sharded")` differs
  only in naming the model `model`);
- `meta.pt`: Lightning's non-tensor state (loops, callbacks, schedulers, hyperparameters, precision) plus our own
  record under `dpar` (format version, layout, per-rank RNG streams, data position, file checksums), written last.

While it is being written the directory has a hidden temporary name (`.dpar-partial-...`); it gets its final name
only when every rank's files and `meta.pt` are complete.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from lightning_dpar.checkpoint.errors import CheckpointLoadError, CorruptCheckpointError
from lightning_dpar.checkpoint.safe_io import load_bytes_item, read_dcp_index, safe_torch_load
from lightning_dpar.checkpoint.storage import Location

__all__ = [
    "DPAR_KEY",
    "FORMAT_VERSION",
    "METADATA_FILENAME",
    "MODEL_KEY",
    "PARTIAL_PREFIX",
    "REPLACED_PREFIX",
    "CheckpointInfo",
    "DirectoryScan",
    "LoadReport",
    "check_data_files",
    "check_format_version",
    "checkpoint_problem",
    "describe_problem",
    "file_checksum",
    "inspect_checkpoint",
    "is_complete_checkpoint",
    "is_data_file",
    "optimizer_key",
    "partial_name",
    "partial_names_for",
    "written_at",
]

METADATA_FILENAME = "meta.pt"
DCP_INDEX_FILENAME = ".metadata"
MODEL_KEY = "state_dict"
#: Lightning's `FSDPStrategy(state_dict_type="sharded")` stores the model under this key instead.
FSDP1_MODEL_KEY = "model"
#: Key of our own record inside `meta.pt`.
DPAR_KEY = "dpar"
FORMAT_VERSION = 1
PARTIAL_PREFIX = ".dpar-partial-"
REPLACED_PREFIX = ".dpar-replaced-"


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def partial_name(final_name: str, token: str) -> str:
    """Hidden name of a checkpoint being written. It never ends in `.ckpt` nor starts with `last`, so Lightning's
    `ModelCheckpoint` (which lists `last*.ckpt` for `ckpt_path="last"`) never sees an incomplete checkpoint."""
    return f"{PARTIAL_PREFIX}{_name_digest(final_name)}-{token}"


def partial_names_for(final_name: str, names: list[str]) -> list[str]:
    """Leftover temporary directories of earlier, interrupted saves to `final_name`."""
    prefix = f"{PARTIAL_PREFIX}{_name_digest(final_name)}-"
    return [n for n in names if n.startswith(prefix) or n.startswith(REPLACED_PREFIX + _name_digest(final_name))]


def _name_digest(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()[:10]


def is_data_file(name: str) -> bool:
    return name.endswith(".distcp")


def file_checksum(location: Location) -> tuple[int, int]:
    """(size, crc32) of one file, streamed in 1 MiB pieces (memory stays flat on any file size)."""
    crc, size = 0, 0
    with location.open("rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def written_at(checkpoint: Location) -> float:
    """When a checkpoint was completed: its `meta.pt`'s time (written last; object stores have no directory times),
    or a full-format file's own; 0 where the filesystem does not say."""
    target = checkpoint.child(METADATA_FILENAME) if checkpoint.is_dir() else checkpoint
    try:
        return target.fs.modified(target.path).timestamp()
    except (NotImplementedError, OSError, AttributeError, ValueError):
        return 0.0


def checkpoint_problem(location: Location) -> str | None:
    """Why `location` is not a complete, readable checkpoint, or None: a sharded directory needs its index and
    `meta.pt` (written last), both readable, and every data file the index names, each at least as long as the index
    needs; a full-format file must be readable. A link counts as what it points at, so a link to a save that never
    completed is a problem. Cheap: the data files are sized, not read (the load checks their checksums)."""
    if not location.exists():
        if location.is_local and os.path.islink(location.path):
            return f"a link to {os.readlink(location.path)!r}, which does not exist (its save never completed)"
        return "it does not exist"
    if not location.is_dir():
        return _unreadable(safe_torch_load, location)
    names = set(location.list_names())
    missing = [n for n in (DCP_INDEX_FILENAME, METADATA_FILENAME) if n not in names]
    if missing:
        return f"it lacks {', '.join(map(repr, missing))} (a save that did not complete, or not a checkpoint)"
    try:
        index = read_dcp_index(location)
    except CheckpointLoadError as error:
        return str(error)
    problem = _unreadable(safe_torch_load, location.child(METADATA_FILENAME))
    if problem is not None:
        return problem
    needed: dict[str, int] = {}
    for storage in (index.storage_data or {}).values():
        needed[storage.relative_path] = max(needed.get(storage.relative_path, 0), storage.offset + storage.length)
    for name, size in sorted(needed.items()):
        if name not in names:
            return f"its data file {name!r} is missing"
        if (got := location.child(name).size()) < size:
            return f"its data file {name!r} is truncated: {got} bytes, the index needs at least {size}"
    return None


def _unreadable(read: Callable[[Location], Any], location: Location) -> str | None:
    try:
        read(location)
    except CheckpointLoadError as error:
        return str(error)
    return None


def is_complete_checkpoint(location: Location) -> bool:
    """Whether `checkpoint_problem` finds nothing wrong with `location`."""
    return checkpoint_problem(location) is None


@dataclass
class DirectoryScan:
    """The checkpoints of one directory: complete ones with when they were written (`written_at`), and the others
    with why (`checkpoint_problem`); interrupted saves (hidden `.dpar-partial-`/`.dpar-replaced-` names) are
    incomplete."""

    complete: dict[Location, float] = field(default_factory=dict)
    incomplete: dict[Location, str] = field(default_factory=dict)

    @classmethod
    def of(cls, directory: Location, accept: Callable[[Location], bool]) -> DirectoryScan:
        """Scan the entries of `directory` that `accept` takes for checkpoints."""
        scan = cls()
        for name in directory.list_names():
            entry = directory.child(name)
            if name.startswith((PARTIAL_PREFIX, REPLACED_PREFIX)):
                scan.incomplete[entry] = "a save into it was interrupted"
            elif accept(entry):
                problem = checkpoint_problem(entry)
                if problem is None:
                    scan.complete[entry] = written_at(entry)
                else:
                    scan.incomplete[entry] = problem
        return scan


def newest_other_checkpoint(location: Location) -> Location | None:
    """The most recently written other complete checkpoint beside `location` (same format), or None.

    Sharded: a directory with its index, `meta.pt` and the data files the index names; full: a readable file with
    the same suffix. Hidden names (temporary and replaced checkpoints) and links to `location`
    (`save_last="link"`) are skipped.
    """
    sharded = location.is_dir()
    suffix = posixpath.splitext(location.name)[1]

    def same_format(other: Location) -> bool:
        if other.name == location.name or other.name.startswith(".") or _same_file(other, location):
            return False
        return other.is_dir() == sharded and (sharded or other.name.endswith(suffix))

    complete = DirectoryScan.of(location.parent, accept=same_format).complete
    return max(complete, key=complete.__getitem__, default=None)


def _same_file(a: Location, b: Location) -> bool:
    return a.is_local and os.path.realpath(a.path) == os.path.realpath(b.path)


def corruption_remedy(location: Location, file_name: str | None = None) -> str:
    """What to do about a damaged checkpoint: fetch the file again, or fall back to the newest other checkpoint."""
    if file_name is not None and is_data_file(file_name):
        fetch = (
            f"Copy {file_name!r} again from the machine that wrote it (each rank writes its own"
            " `__<rank>_<i>.distcp` on its node's disk)"
        )
    else:
        fetch = "If it was copied here, copy it again from where it was written"
    previous = newest_other_checkpoint(location)
    fallback = (
        f"or resume from the previous checkpoint: {previous.url!r} is the newest other complete one in"
        f" {location.parent.url!r}"
        if previous is not None
        else f"or resume from an earlier checkpoint (there is no other complete one in {location.parent.url!r})"
    )
    return f"{fetch}, {fallback}; if the run that wrote it is still going, save again."


@dataclass(frozen=True)
class CheckpointInfo:
    """A validated sharded checkpoint: its DCP index, its `meta.pt` content and which key holds the model."""

    location: Location
    index: Metadata
    metadata: dict
    model_key: str

    @property
    def dpar_record(self) -> dict:
        return self.metadata.get(DPAR_KEY, {})

    def keys_under(self, top_key: str) -> set[str]:
        """Flattened FQNs stored under `top_key` (e.g. the model's parameter names under `state_dict`)."""
        prefix = f"{top_key}."
        return {k[len(prefix) :] for k in self.index.state_dict_metadata if k.startswith(prefix)}

    def has_key(self, top_key: str) -> bool:
        return bool(self.keys_under(top_key))


def describe_problem(location: Location) -> str | None:
    """Why `location` is not a loadable sharded checkpoint directory, or None if it looks like one."""
    url = location.url
    if location.name.startswith((PARTIAL_PREFIX, REPLACED_PREFIX)):
        return (
            f"{url!r} is an incomplete checkpoint: a save into it was interrupted (or is still running) before every"
            " rank's files and the metadata were written. Load the previous complete checkpoint instead."
        )
    if not location.exists():
        hint = ""
        parent = location.parent
        for leftover in partial_names_for(location.name, parent.list_names()):
            if METADATA_FILENAME in parent.child(leftover).list_names():
                complete = parent.child(leftover).url
                hint = (
                    f" A save that replaced it was interrupted; {complete!r} is a complete checkpoint: rename it to"
                    f" {location.name!r} to use it."
                )
        return (
            f"Checkpoint path {url!r} does not exist. Check the path (and, for `ckpt_path='last'`, the dirpath).{hint}"
        )
    if not location.is_dir():
        return None  # a single file: the "full" format, read with torch.load
    names = set(location.list_names())
    missing = [n for n in (DCP_INDEX_FILENAME, METADATA_FILENAME) if n not in names]
    if missing:
        return (
            f"{url!r} is a directory but not a sharded checkpoint: it lacks {', '.join(map(repr, missing))}. Expected"
            f" the DCP index {DCP_INDEX_FILENAME!r}, `__<rank>_<i>.distcp` data files and {METADATA_FILENAME!r} (a"
            " checkpoint saved by lightning_dpar, ModelParallelStrategy or FSDPStrategy(state_dict_type='sharded'))."
        )
    return None


@dataclass
class LoadReport:
    """What a non-strict load left out: model keys the checkpoint lacks, and checkpoint keys the model lacks."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def check_format_version(metadata: dict[str, Any], location: Location) -> None:
    """Refuse a checkpoint written by a newer lightning_dpar in a format this one cannot read."""
    version = metadata.get(DPAR_KEY, {}).get("format_version", FORMAT_VERSION)
    if version > FORMAT_VERSION:
        raise CheckpointLoadError(
            f"{location.url!r} was written in checkpoint format {version}; this lightning_dpar reads up to"
            f" {FORMAT_VERSION}. Upgrade lightning_dpar."
        )


def inspect_checkpoint(location: Location) -> CheckpointInfo:
    """Read and check the index and metadata of a sharded checkpoint; raise `CheckpointLoadError` if unusable."""
    problem = describe_problem(location)
    if problem is not None:
        raise CheckpointLoadError(problem)
    index = read_with_remedy(read_dcp_index, location, DCP_INDEX_FILENAME)
    metadata = read_with_remedy(safe_torch_load, location.child(METADATA_FILENAME), METADATA_FILENAME, location)
    if not isinstance(metadata, dict):
        raise CheckpointLoadError(f"{location.child(METADATA_FILENAME).url!r} does not hold a dict of metadata.")
    check_format_version(metadata, location)
    info_keys = {k.split(".", 1)[0] for k in index.state_dict_metadata}
    model_key = MODEL_KEY if MODEL_KEY in info_keys else FSDP1_MODEL_KEY if FSDP1_MODEL_KEY in info_keys else None
    if model_key is None:
        raise CheckpointLoadError(
            f"{location.url!r} holds no model state: its DCP index has the keys {sorted(info_keys)}, expected"
            f" {MODEL_KEY!r} (or {FSDP1_MODEL_KEY!r} from FSDPStrategy)."
        )
    return CheckpointInfo(location, index, metadata, model_key)


def read_with_remedy(
    read: Callable[[Location], Any], target: Location, file_name: str | None = None, checkpoint: Location | None = None
) -> Any:
    """`read(target)`, adding to a corruption error what to do about it (unsafe content gets no such advice)."""
    try:
        return read(target)
    except CorruptCheckpointError as error:
        raise CorruptCheckpointError(f"{error} {corruption_remedy(checkpoint or target, file_name)}") from None


def check_data_files(info: CheckpointInfo, rank: int, world_size: int) -> str | None:
    """Verify the data files against the index (sizes) and the saved checksums, and vet their non-tensor leaves
    (`weights_only`, as the load will); `rank` checks every `world_size`-th file, so together the ranks check each
    file once (callers share what any rank found). Returns a problem description, with what to do, or None."""
    needed: dict[str, int] = {}
    leaves: dict[str, list[tuple[str, Any]]] = {}
    for key, storage in (info.index.storage_data or {}).items():
        name = str(storage.relative_path)
        needed[name] = max(needed.get(name, 0), int(storage.offset) + int(storage.length))
        if isinstance(info.index.state_dict_metadata.get(key.fqn), BytesStorageMetadata):
            leaves.setdefault(name, []).append((key.fqn, storage))
    recorded: dict[str, tuple[int, int]] = info.dpar_record.get("files", {})
    for name in sorted(needed)[rank::world_size]:
        problem = _data_file_problem(info, name, needed[name], recorded.get(name))
        if problem is not None:
            return f"{problem} {corruption_remedy(info.location, name)}"
        try:
            _vet_leaves(info.location.child(name), leaves.get(name, []))
        except CheckpointLoadError as error:
            return str(error)
    return None


def _data_file_problem(info: CheckpointInfo, name: str, needed: int, recorded: tuple[int, int] | None) -> str | None:
    file = info.location.child(name)
    if not file.exists():
        return f"{file.url!r} is missing: the checkpoint is incomplete (a rank's shard was deleted or not copied)."
    size = file.size()
    if size < needed:
        return f"{file.url!r} is truncated: {size} bytes, the index needs at least {needed}."
    if recorded is not None:
        got_size, got_crc = file_checksum(file)
        if (got_size, got_crc) != tuple(recorded):
            return (
                f"{file.url!r} is corrupted: size/crc32 {got_size}/{got_crc:#010x}, written as"
                f" {recorded[0]}/{recorded[1]:#010x}."
            )
    return None


def _vet_leaves(file: Location, leaves: list[tuple[str, Any]]) -> None:
    """Load each non-tensor leaf of `file` `weights_only` (they are small: optimizer hyperparameters), so content
    that would run code is refused before the collective load, identically on every rank."""
    plain = [(fqn, storage) for fqn, storage in leaves if not getattr(storage, "transform_descriptors", None)]
    if not plain:
        return
    with file.open("rb") as f:
        for fqn, storage in plain:
            f.seek(int(storage.offset))
            load_bytes_item(f.read(int(storage.length)), f"In {file.url!r}: the non-tensor item {fqn!r}")
