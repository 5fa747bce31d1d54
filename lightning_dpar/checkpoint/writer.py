"""Writing a sharded checkpoint atomically, in the foreground or in the background.

Atomic: every rank writes into a hidden sibling directory (`layout.partial_name`); only after all ranks' data files
are written (DCP's coordinator gathers every rank's write results before writing the index) and checksummed does
rank 0 write `meta.pt` and rename the directory to its final name. A process killed at any moment leaves either the
previous checkpoint under the final name or the new complete one; never a partial one under a checkpoint name.

Async (`async_save=True`): DCP stages the shards to CPU memory and writes them from a background thread over a
dedicated gloo process group (so its collectives never interleave with training's); the finishing step (checksums,
`meta.pt`, rename) also runs in the background. The next save, a removal of the in-flight checkpoint, and the end
of `fit` wait for it, so whatever Lightning's `ModelCheckpoint` refers to is complete by the time it is used.
"""

from __future__ import annotations

import copy
import logging
import os
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lightning_dpar.checkpoint.layout import (
    DPAR_KEY,
    METADATA_FILENAME,
    PARTIAL_PREFIX,
    REPLACED_PREFIX,
    file_checksum,
    is_data_file,
    partial_name,
    partial_names_for,
)
from lightning_dpar.checkpoint.storage import Location

__all__ = [
    "CheckpointWriter",
    "publish",
    "remove_leftovers",
]

log = logging.getLogger(__name__)


@dataclass
class SaveTiming:
    """Seconds the caller was blocked by one save (staging included), and the end-to-end write time."""

    blocked_s: float
    total_s: float | None = None


class CheckpointWriter:
    """Owns the in-flight save of one strategy; see the module docstring for the guarantees."""

    def __init__(self, async_save: bool = False) -> None:
        self.async_save = async_save
        self._executor: ThreadPoolExecutor | None = None
        self._group: dist.ProcessGroup | None = None
        self._pending: Future | None = None
        self._pending_target: str | None = None
        self.timings: deque[SaveTiming] = deque(maxlen=100)  # recent saves, for benchmarks and logs

    # ------------------------------------------------------------------ public
    def save(self, tensor_state: dict[str, Any], metadata: dict[str, Any], location: Location) -> None:
        """Write `tensor_state` (DCP, every rank its shards) and `metadata` (rank 0) to `location`; collective."""
        start = time.perf_counter()
        self.wait()
        partial = _prepare_partial_directory(location)
        timing = SaveTiming(blocked_s=0.0)
        self.timings.append(timing)
        if not self.async_save:
            dcp.save(tensor_state, checkpoint_id=partial.url)
            _finish(partial, location, metadata, group=None)
            timing.blocked_s = timing.total_s = time.perf_counter() - start
            return
        group = self._checkpoint_group()
        # Training goes on mutating callbacks' state; only rank 0 writes the metadata, so only it keeps a copy.
        metadata = copy.deepcopy(metadata) if not dist.is_initialized() or dist.get_rank() == 0 else {}
        upload = dcp.async_save(tensor_state, checkpoint_id=partial.url, process_group=group)
        timing.blocked_s = time.perf_counter() - start

        def finish_in_background() -> None:
            _result(upload).result()
            _finish(partial, location, metadata, group=group)
            timing.total_s = time.perf_counter() - start

        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpar-checkpoint")
        self._pending = self._executor.submit(finish_in_background)
        self._pending_target = location.url

    def wait(self) -> None:
        """Block until the in-flight background save (if any) is complete under its final name; re-raise its error."""
        pending, target = self._pending, self._pending_target
        if pending is None:
            return
        self._pending = self._pending_target = None
        try:
            pending.result()
        except Exception as error:
            raise RuntimeError(f"The background save of checkpoint {target!r} failed: {error}") from error

    def is_pending(self, url: str) -> bool:
        return self._pending is not None and self._pending_target == url

    def close(self) -> None:
        """Finish the in-flight save and stop the background thread (strategy teardown, also after an error).

        A failure is logged rather than raised: on the normal path the end of `fit` has already waited (and raised),
        and after an exception raising here would hide the original error.
        """
        try:
            self.wait()
        except RuntimeError as error:
            log.error(str(error))
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ------------------------------------------------------------------ internals
    def _checkpoint_group(self) -> dist.ProcessGroup | None:
        if not dist.is_initialized():
            return None
        if self._group is None:
            # Collective on every rank (all ranks save together). Gloo: DCP's background collectives run on CPU.
            self._group = dist.new_group(backend="gloo")
        return self._group


def _result(upload: Any) -> Future:
    """`dcp.async_save` returns a Future, or an `AsyncSaveResponse` with the upload future in it."""
    return getattr(upload, "upload_completion", upload)


def _prepare_partial_directory(location: Location) -> Location:
    """Rank 0 sweeps leftovers of killed saves and creates the hidden directory this save writes into, then tells
    every rank its name (the broadcast also makes the others wait until it exists); collective."""
    name, error = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        name = partial_name(location.name, uuid.uuid4().hex[:8])
        try:
            remove_leftovers(location)
            location.sibling(name).makedirs()
        except OSError as exc:  # sent to every rank, so none waits in a collective rank 0 never joins
            error = f"rank 0 could not prepare {location.sibling(name).url!r}: {exc}"
    if dist.is_initialized():
        holder = [(name, error)]
        dist.broadcast_object_list(holder, src=0)
        name, error = holder[0]
    if error is not None:
        raise RuntimeError(f"Saving checkpoint {location.url!r} failed: {error}")
    assert name is not None
    return location.sibling(name)


def _finish(partial: Location, final: Location, metadata: dict[str, Any], group: dist.ProcessGroup | None) -> None:
    """After DCP wrote every rank's data: checksum, write `meta.pt`, rename into place. Collective over `group`."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    files: dict[str, tuple[int, int]] = {}
    error: str | None = None
    try:
        for name in partial.list_names():
            if is_data_file(name) and name.startswith(f"__{rank}_"):
                files[name] = file_checksum(partial.child(name))
    except OSError as exc:
        error = f"rank {rank} could not read back its shard: {exc}"
    gathered: list[Any] = [(files, error)]
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (files, error), group=group)
    errors = [e for _, e in gathered if e]
    if rank == 0 and not errors:
        try:
            record = dict(metadata.get(DPAR_KEY, {}))
            record["files"] = {name: checksum for rank_files, _ in gathered for name, checksum in rank_files.items()}
            partial.child(METADATA_FILENAME).write_torch({**metadata, DPAR_KEY: record})
            publish(partial, final)
        except Exception as exc:  # reported to every rank below, so none waits forever
            errors.append(f"rank 0 could not write the metadata or rename into place: {exc}")
    outcome = [errors[0] if errors else None]
    if dist.is_initialized():
        dist.broadcast_object_list(outcome, src=0, group=group)  # the checkpoint group spans all ranks: 0 is 0
    if outcome[0] is not None:
        raise RuntimeError(
            f"Saving checkpoint {final.url!r} failed ({outcome[0]}); {partial.url!r} is left incomplete."
        )


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
