"""The atomic steps of a save, shared by the sharded writer (`checkpoint.writer`) and the full format: the hidden
partial directory a save writes into (`prepare_partial_directory`), publishing it under its final name
(`publish`, which moves an older checkpoint of that name aside first), sweeping what killed saves left
(`remove_leftovers`), `save_last="link"` links replaced in one rename (`point_link`), and turning any failure into
one `CheckpointSaveError` after removing what was written (`reported_as_save_error`).
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from lightning_dpar.checkpoint.contents import (
    METADATA_FILENAME,
    PARTIAL_PREFIX,
    REPLACED_PREFIX,
    partial_name,
    partial_names_for,
)
from lightning_dpar.checkpoint.errors import CheckpointSaveError, describe_dcp_failures
from lightning_dpar.checkpoint.storage import Location

__all__ = [
    "point_link",
    "prepare_partial_directory",
    "publish",
    "rank_in",
    "remove_leftovers",
    "reported_as_save_error",
    "with_per_rank",
    "write_metadata_and_publish",
]

log = logging.getLogger(__name__)


def rank_in(group: dist.ProcessGroup | None) -> int:
    """This rank's rank in `group` (0 without a process group)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def _is_timeout(error: BaseException) -> bool:
    causes = [error, *(e for e, _ in getattr(error, "failures", {}).values())]
    return any("timed out" in str(e).lower() or "timeout" in type(e).__name__.lower() for e in causes)


def _describe(error: BaseException) -> str:
    """Each failing rank's cause for DCP's `CheckpointException`, one per rank (a save's message names them all)."""
    if isinstance(error, CheckpointException):
        return describe_dcp_failures(error, merge_ranks=False)
    return f"{type(error).__name__}: {error}"


@contextmanager
def reported_as_save_error(final: Location, partial: Location, timeout: timedelta | None) -> Iterator[None]:
    """Turn any failure of a save (DCP's `CheckpointException` derives from `BaseException`) into a
    `CheckpointSaveError` naming the checkpoint and the cause, after removing what was written (rank 0)."""
    try:
        yield
    except CheckpointSaveError:
        _discard(partial)
        raise
    except (CheckpointException, Exception) as error:
        _discard(partial)
        cause = _describe(error)
        if _is_timeout(error):
            limit = f"{timeout.total_seconds():.0f} s" if timeout is not None else "the collective timeout"
            cause = (
                f"a rank stopped responding during the checkpoint write (no reply within the strategy's timeout of"
                f" {limit}; it died, froze or lost its network): {cause}"
            )
        raise CheckpointSaveError(
            f"Saving checkpoint {final.url!r} failed: {cause}. Nothing was published under that name and the previous"
            " checkpoint is untouched; fix the cause (free space, permissions, the failed rank) and save again."
        ) from error


def _discard(partial: Location) -> None:
    if rank_in(None) == 0:
        try:
            partial.remove()
        except OSError as error:  # the original failure matters more; the sweep of the next save retries
            log.warning(f"Could not remove the incomplete checkpoint {partial.url!r}: {error}")


def prepare_partial_directory(path: str, group: dist.ProcessGroup | None) -> tuple[Location, Location]:
    """Rank 0 sweeps leftovers of killed saves to its `path` and creates the hidden directory this save writes into,
    then tells every rank both (one broadcast, which also makes the others wait until the directory exists; callbacks
    may format per-rank paths, e.g. with a timestamp, so rank 0's path is the one); collective over `group`."""
    url, name, error = path, None, None
    if rank_in(None) == 0:
        location = Location.parse(path)
        url, name = location.url, partial_name(location.name, uuid.uuid4().hex[:8])
        try:
            remove_leftovers(location)
            location.sibling(name).makedirs()
        except OSError as exc:  # sent to every rank, so none waits in a collective rank 0 never joins
            error = f"rank 0 could not create {location.sibling(name).url!r}: {type(exc).__name__}: {exc}"
    if dist.is_initialized():
        holder = [(url, name, error)]
        dist.broadcast_object_list(holder, src=0, group=group)  # global rank 0, also rank 0 of the checkpoint group
        url, name, error = holder[0]
    if error is not None:
        raise CheckpointSaveError(
            f"Saving checkpoint {url!r} failed: {error}. Check that the directory is writable and has space."
        )
    assert name is not None
    location = Location.parse(url)
    return location, location.sibling(name)


def with_per_rank(record: dict[str, Any], per_rank_values: list[dict[str, Any]]) -> dict[str, Any]:
    """`record` plus, for each key of the ranks' `per_rank` values, the list of every rank's value in rank order
    (e.g. `rng_states`: one RNG state per rank)."""
    keys = per_rank_values[0].keys() if per_rank_values else ()
    return {**record, **{key: [values[key] for values in per_rank_values] for key in keys}}


def write_metadata_and_publish(partial: Location, final: Location, metadata: dict[str, Any]) -> str | None:
    try:
        partial.child(METADATA_FILENAME).write_torch(metadata)
        publish(partial, final)
    except OSError as exc:
        return f"rank 0 could not write the metadata or rename into place: {type(exc).__name__}: {exc}"
    return None


def remove_leftovers(location: Location) -> None:
    """Delete what earlier, killed saves to `location`'s name left beside it (rank 0, before a new save)."""
    parent = location.parent
    for leftover in partial_names_for(location.name, parent.list_names()):
        parent.child(leftover).remove()


def publish(partial: Location, final: Location) -> None:
    """Give the complete checkpoint (file or directory) its final name, replacing an older one of the same name
    (e.g. `last.ckpt`): the old one is moved aside first, so a kill in between leaves it recoverable."""
    replaced = None
    if final.exists() or (final.is_local and os.path.lexists(final.path)):  # lexists: a `save_last="link"` link
        replaced = final.sibling(REPLACED_PREFIX + partial.name[len(PARTIAL_PREFIX) :])
        final.rename_to(replaced)
    partial.rename_to(final)
    if replaced is not None:
        replaced.remove()


def point_link(target: Location, link: Location) -> None:
    """Make `link` a relative symbolic link to `target`, as `ModelCheckpoint(save_last="link")` does, but replacing
    an existing link in one rename, so a reader never finds it missing. A directory or file standing at `link` (an
    earlier `save_last=True` copy) is removed first; where links cannot be made, `target` is copied (as Lightning
    does)."""
    if not link.is_local or os.path.abspath(link.path) == os.path.abspath(target.path):
        return
    if os.path.isdir(link.path) and not os.path.islink(link.path):
        link.remove()
    temporary = link.sibling(f".dpar-link-{uuid.uuid4().hex[:8]}")  # hidden, and no `.ckpt`: never a checkpoint
    try:
        os.symlink(os.path.relpath(target.path, os.path.dirname(link.path)), temporary.path)
    except OSError:  # e.g. Windows without the privilege to make links
        link.remove()
        if os.path.isdir(target.path):
            shutil.copytree(target.path, link.path)
        else:
            shutil.copy(target.path, link.path)
        return
    os.replace(temporary.path, link.path)
