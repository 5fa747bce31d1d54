"""What a checkpoint directory contains, how to recognise each kind, and how to tell a user what is wrong with one.

A sharded checkpoint (the default format) is a directory:

- DCP data files (`__<rank>_<i>.distcp`) and DCP's index `.metadata`, holding the model under `state_dict` and each
  optimizer under `optimizer_<i>`, every rank writing only its shards (the layout of Lightning's
  `ModelParallelStrategy`, so checkpoints move both ways; `FSDPStrategy(state_dict_type="sharded")` differs only in
  naming the model `model`);
- `meta.pt`: Lightning's non-tensor state (loops, callbacks, schedulers, hyperparameters, precision) plus our own
  record under `dpar` (format version, layout, per-rank RNG streams, data position, file checksums), written last.

While it is being written the directory has a hidden temporary name (`.dpar-partial-...`); it gets its final name
only when every rank's files and `meta.pt` are complete.
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from lightning_dpar.checkpoint.safe_io import CheckpointLoadError, read_dcp_index, safe_torch_load
from lightning_dpar.checkpoint.storage import Location

__all__ = [
    "DPAR_KEY",
    "FORMAT_VERSION",
    "METADATA_FILENAME",
    "MODEL_KEY",
    "PARTIAL_PREFIX",
    "REPLACED_PREFIX",
    "CheckpointInfo",
    "LoadReport",
    "check_data_files",
    "check_format_version",
    "describe_problem",
    "file_checksum",
    "inspect_checkpoint",
    "is_data_file",
    "optimizer_key",
    "partial_name",
    "partial_names_for",
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
    index = read_dcp_index(location)
    metadata = safe_torch_load(location.child(METADATA_FILENAME))
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


def check_data_files(info: CheckpointInfo, rank: int, world_size: int) -> str | None:
    """Verify the data files against the index (sizes) and the saved checksums; `rank` checks every
    `world_size`-th file, so together the ranks check each file once (callers share what any rank found).
    Returns a problem description or None."""
    needed: dict[str, int] = {}
    for storage in (info.index.storage_data or {}).values():
        name = str(storage.relative_path)
        needed[name] = max(needed.get(name, 0), int(storage.offset) + int(storage.length))
    recorded: dict[str, tuple[int, int]] = info.dpar_record.get("files", {})
    for name in sorted(needed)[rank::world_size]:
        file = info.location.child(name)
        if not file.exists():
            return f"{file.url!r} is missing: the checkpoint is incomplete (a rank's shard was deleted or not copied)."
        size = file.size()
        if size < needed[name]:
            return f"{file.url!r} is truncated: {size} bytes, the index needs at least {needed[name]}."
        if name in recorded:
            want_size, want_crc = recorded[name]
            got_size, got_crc = file_checksum(file)
            if (got_size, got_crc) != (want_size, want_crc):
                return (
                    f"{file.url!r} is corrupted: size/crc32 {got_size}/{got_crc:#010x}, written as"
                    f" {want_size}/{want_crc:#010x}."
                )
    return None
