"""Writing a sharded checkpoint atomically, in the foreground or in the background, and removing superseded ones
only once their replacement is complete.

Atomic: every rank writes into a hidden sibling directory (`layout.partial_name`); only after all ranks' data files
are written (DCP's coordinator gathers every rank's write results before writing the index) and checksummed does
rank 0 write `meta.pt` and rename the directory to its final name. A process killed at any moment leaves either the
previous checkpoint under the final name or the new complete one; never a partial one under a checkpoint name.

Async (`async_save=True`): DCP stages the shards to CPU memory and writes them from a background thread over a
dedicated gloo process group (so its collectives never interleave with training's) created with the strategy's
timeout; the finishing step (checksums, `meta.pt`, rename) also runs in the background. The next save, a load and
the end of `fit` wait for it. A checkpoint that Lightning's `ModelCheckpoint` supersedes while the new one is still
being written is removed only after the new one is complete under its final name, so a kill at any moment leaves
the last complete checkpoint on disk.

Failures: a full disk, a read-only target, a rank that dies or stops responding: every rank raises a
`CheckpointSaveError` that names the checkpoint and the cause, the partial directory is removed, and the previous
checkpoint is untouched.
"""

from __future__ import annotations

import copy
import logging
import os
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from lightning_dpar.checkpoint.agreement import first_problem
from lightning_dpar.checkpoint.errors import CheckpointSaveError
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
from lightning_dpar.checkpoint.staging import ReusedBufferStager
from lightning_dpar.checkpoint.storage import Location

__all__ = ["CheckpointWriter", "SaveTiming", "publish", "remove_leftovers"]

log = logging.getLogger(__name__)

#: Extra seconds teardown waits for a background save beyond the collective timeout before abandoning it.
CLOSE_MARGIN_S = 15.0


@dataclass
class SaveTiming:
    """Seconds the caller was blocked by one save (staging included), and the end-to-end write time."""

    blocked_s: float
    total_s: float | None = None


@dataclass
class _InFlight:
    """A background save: its target, its outcome, and the checkpoints to remove once it is published."""

    target: Location
    done: Future = field(default_factory=Future)
    published: bool = False
    removals: list[Location] = field(default_factory=list)


class CheckpointWriter:
    """Owns the in-flight save of one strategy; see the module docstring for the guarantees."""

    def __init__(self, async_save: bool = False, timeout: timedelta | None = None) -> None:
        self.async_save = async_save
        self.timeout = timeout
        self._group: dist.ProcessGroup | None = None
        self._in_flight: _InFlight | None = None
        self._stager: ReusedBufferStager | None = None
        self._lock = threading.Lock()  # guards `_in_flight.published` / `.removals` against the background thread
        self._jobs: queue.SimpleQueue | None = None  # the background thread's work, one save's finishing at a time
        self.timings: deque[SaveTiming] = deque(maxlen=100)  # recent saves, for benchmarks and logs

    # ------------------------------------------------------------------ public
    def save(self, tensor_state: dict[str, Any], metadata: dict[str, Any], path: str) -> None:
        """Write `tensor_state` (DCP, every rank its shards) and `metadata` (rank 0) to rank 0's `path`; collective."""
        start = time.perf_counter()
        self.wait()
        location, partial = _prepare_partial_directory(path)
        timing = SaveTiming(blocked_s=0.0)
        self.timings.append(timing)
        if not self.async_save:
            with _reported_as_save_error(location, partial, self.timeout):
                dcp.save(tensor_state, checkpoint_id=partial.url)
                _finish(partial, location, metadata, group=None)
            timing.blocked_s = timing.total_s = time.perf_counter() - start
            return
        group = self._checkpoint_group()
        # Training goes on mutating callbacks' state; only rank 0 writes the metadata, so only it keeps a copy.
        metadata = copy.deepcopy(metadata) if _rank(None) == 0 else {}
        with _reported_as_save_error(location, partial, self.timeout):
            upload = dcp.async_save(
                tensor_state, checkpoint_id=partial.url, process_group=group, async_stager=self._staging_buffers()
            )
        timing.blocked_s = time.perf_counter() - start
        in_flight = _InFlight(location)
        self._in_flight = in_flight

        def finish_in_background() -> None:
            try:
                with _reported_as_save_error(location, partial, self.timeout):
                    _upload_future(upload).result()
                    _finish(partial, location, metadata, group=group)
                timing.total_s = time.perf_counter() - start
                self._removals_after_publish(in_flight)
                in_flight.done.set_result(None)
            except BaseException as error:
                in_flight.done.set_exception(error)

        self._in_background(finish_in_background)

    def remove(self, location: Location, is_global_zero: bool) -> None:
        """Remove a superseded checkpoint (rank 0 deletes). While a background save is in flight the removal waits
        until that save is complete under its final name; removing the in-flight checkpoint itself waits for it."""
        in_flight = self._in_flight
        if in_flight is not None and in_flight.target.url == location.url:
            self.wait()
        elif in_flight is not None:
            with self._lock:
                if not in_flight.published:
                    in_flight.removals.append(location)
                    return
        if is_global_zero:
            location.remove()

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the in-flight background save (if any) is complete under its final name; re-raise its
        `CheckpointSaveError`. With `timeout_s`, give up waiting after that many seconds (raises `TimeoutError`)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.done.result(timeout=timeout_s)

    def close(self) -> None:
        """Teardown, also after an error: wait for the in-flight save at most the collective timeout plus a margin
        (a rank that stopped responding makes the background collectives fail within the timeout), and log rather
        than raise, so an earlier exception stays the one the user sees."""
        bound = (self.timeout.total_seconds() if self.timeout is not None else 1800.0) + CLOSE_MARGIN_S
        in_flight = self._in_flight
        try:
            self.wait(timeout_s=bound)
        except TimeoutError:
            assert in_flight is not None
            log.error(
                f"Checkpoint {in_flight.target.url!r} was still being written {bound:.0f} s after the end of training"
                " and is abandoned; it stays incomplete (hidden) and the previous checkpoint is the last complete one."
            )
            return  # the abandoned upload may still read the staging buffers: they go with the process
        except CheckpointSaveError as error:
            log.error(str(error))
        self._release_staging_buffers()
        self._stop_background_thread()

    def _staging_buffers(self) -> ReusedBufferStager:
        """The stager of every async save of this strategy: it keeps the CPU copies of the shards between saves
        (pinned on GPU machines), so a save copies into memory that is already allocated instead of allocating the
        rank's shard again (`checkpoint.staging`). The copy itself stays synchronous: training may change the
        parameters as soon as `save` returns. Safe to reuse because a save first waits for the previous upload."""
        if self._stager is None:
            self._stager = ReusedBufferStager(pin_memory=torch.cuda.is_available())
        return self._stager

    def _release_staging_buffers(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    # ------------------------------------------------------------------ internals
    def _in_background(self, job: Callable[[], None]) -> None:
        """Run `job` on the writer's background thread, started once. A daemon thread: a save stuck on a dead peer
        must never keep the interpreter from exiting."""
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_run_jobs, args=(self._jobs,), name="dpar-checkpoint", daemon=True).start()
        self._jobs.put(job)

    def _stop_background_thread(self) -> None:
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None

    def _removals_after_publish(self, in_flight: _InFlight) -> None:
        with self._lock:
            in_flight.published = True
            removals, in_flight.removals = in_flight.removals, []
        if _rank(None) == 0:
            for superseded in removals:
                superseded.remove()

    def _checkpoint_group(self) -> dist.ProcessGroup | None:
        if not dist.is_initialized():
            return None
        if self._group is None:
            # Collective on every rank (all ranks save together). Gloo: DCP's background collectives run on CPU.
            # The strategy's timeout, not torch's 30-minute default: a rank that stops responding fails the save.
            kwargs = {"timeout": self.timeout} if self.timeout is not None else {}
            self._group = dist.new_group(backend="gloo", **kwargs)
        return self._group


def _run_jobs(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        job()


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _upload_future(upload: Any) -> Future:
    """`dcp.async_save` returns a Future, or an `AsyncSaveResponse` with the upload future in it."""
    return getattr(upload, "upload_completion", upload)


def _is_timeout(error: BaseException) -> bool:
    causes = [error, *(e for e, _ in getattr(error, "failures", {}).values())]
    return any("timed out" in str(e).lower() or "timeout" in type(e).__name__.lower() for e in causes)


def _describe(error: BaseException) -> str:
    """One line per failing rank for DCP's `CheckpointException` (whose own text is a dict of tracebacks)."""
    if isinstance(error, CheckpointException):
        return "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, (e, _) in sorted(error.failures.items()))
    return f"{type(error).__name__}: {error}"


@contextmanager
def _reported_as_save_error(final: Location, partial: Location, timeout: timedelta | None) -> Iterator[None]:
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
    if _rank(None) == 0:
        try:
            partial.remove()
        except OSError as error:  # the original failure matters more; the sweep of the next save retries
            log.warning(f"Could not remove the incomplete checkpoint {partial.url!r}: {error}")


def _prepare_partial_directory(path: str) -> tuple[Location, Location]:
    """Rank 0 sweeps leftovers of killed saves to its `path` and creates the hidden directory this save writes into,
    then tells every rank both (one broadcast, which also makes the others wait until the directory exists; callbacks
    may format per-rank paths, e.g. with a timestamp, so rank 0's path is the one); collective."""
    url, name, error = path, None, None
    if _rank(None) == 0:
        location = Location.parse(path)
        url, name = location.url, partial_name(location.name, uuid.uuid4().hex[:8])
        try:
            remove_leftovers(location)
            location.sibling(name).makedirs()
        except OSError as exc:  # sent to every rank, so none waits in a collective rank 0 never joins
            error = f"rank 0 could not create {location.sibling(name).url!r}: {type(exc).__name__}: {exc}"
    if dist.is_initialized():
        holder = [(url, name, error)]
        dist.broadcast_object_list(holder, src=0)
        url, name, error = holder[0]
    if error is not None:
        raise CheckpointSaveError(
            f"Saving checkpoint {url!r} failed: {error}. Check that the directory is writable and has space."
        )
    assert name is not None
    location = Location.parse(url)
    return location, location.sibling(name)


def _finish(partial: Location, final: Location, metadata: dict[str, Any], group: dist.ProcessGroup | None) -> None:
    """After DCP wrote every rank's data: checksum, write `meta.pt`, rename into place. Collective over `group`."""
    rank = _rank(group)
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
    problem = next((e for _, e in gathered if e), None)
    if rank == 0 and problem is None:
        problem = _write_metadata_and_publish(partial, final, metadata, [f for f, _ in gathered])
    problem = first_problem(problem if rank == 0 else None, group)  # rank 0 knows every rank's outcome
    if problem is not None:
        raise CheckpointSaveError(f"Saving checkpoint {final.url!r} failed: {problem}.")


def _write_metadata_and_publish(
    partial: Location, final: Location, metadata: dict[str, Any], files_per_rank: list[dict[str, tuple[int, int]]]
) -> str | None:
    record = dict(metadata.get(DPAR_KEY, {}))
    record["files"] = {name: checksum for rank_files in files_per_rank for name, checksum in rank_files.items()}
    try:
        partial.child(METADATA_FILENAME).write_torch({**metadata, DPAR_KEY: record})
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
