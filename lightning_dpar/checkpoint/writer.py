"""Writing a sharded checkpoint atomically, in the foreground or in the background, and removing superseded ones
only once their replacement is complete.

Atomic: every rank writes into a hidden sibling directory (`checkpoint.atomic`); only after all ranks' data files
are written (DCP's coordinator gathers every rank's write results before writing the index) and checksummed does
rank 0 write `meta.pt` and rename the directory to its final name. A process killed at any moment leaves either the
previous checkpoint under the final name or the new complete one; never a partial one under a checkpoint name.

Async (`async_save=True`): training is blocked only while this rank's shards are copied into CPU buffers reused
from save to save (`checkpoint.staging`) and rank 0 copies the metadata. Everything else runs on the writer's one
background thread, over a dedicated gloo process group (so its collectives never interleave with training's) created
with the strategy's timeout: rank 0's path and the partial directory, DCP's planning and write (`dcp.save` of the
staged copy), and the finishing step (checksums, `meta.pt`, rename). That is what `dcp.async_save` does with its
own thread per save, except that the partial directory, a collective, would have to exist before it is called: in
front of the save. The next save, a load and the end of `fit` wait for it. A checkpoint that Lightning's
`ModelCheckpoint` supersedes while the new one is still being written is removed only after the new one is complete
under its final name, so a kill at any moment leaves the last complete checkpoint on disk.

Failures: a full disk, a read-only target, a rank that dies or stops responding: every rank raises a
`CheckpointSaveError` that names the checkpoint and the cause, the partial directory is removed, and the previous
checkpoint is untouched.
"""

from __future__ import annotations

import atexit
import copy
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lightning_dpar.agreement import first_problem
from lightning_dpar.checkpoint.atomic import (
    point_link,
    prepare_partial_directory,
    rank_in,
    reported_as_save_error,
    with_per_rank,
    write_metadata_and_publish,
)
from lightning_dpar.checkpoint.contents import DPAR_KEY, file_checksum, is_data_file
from lightning_dpar.checkpoint.errors import CheckpointSaveError
from lightning_dpar.checkpoint.staging import ReusedBufferStager
from lightning_dpar.checkpoint.storage import Location

__all__ = ["CheckpointWriter", "SaveTiming"]

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
    links: list[tuple[Location, Location]] = field(default_factory=list)  # (target, link) to point once published


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
        self._thread: threading.Thread | None = None
        self.timings: deque[SaveTiming] = deque(maxlen=100)  # recent saves, for benchmarks and logs

    def __getstate__(self) -> dict[str, Any]:
        """The settings alone: what `start_method="spawn"` sends each new rank with the strategy (its lock, thread
        and process group cannot travel, and a fresh rank has no save of its own in flight)."""
        if self._in_flight is not None or self._thread is not None:
            raise TypeError(
                "A checkpoint writer with a save in flight cannot be sent to another process: call"
                " `strategy.wait_for_checkpoint()` first."
            )
        return {"async_save": self.async_save, "timeout": self.timeout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    # ------------------------------------------------------------------ public
    def save(
        self, tensor_state: dict[str, Any], metadata: dict[str, Any], path: str, per_rank: dict[str, Any] | None = None
    ) -> None:
        """Write `tensor_state` (DCP, every rank its shards) and `metadata` (rank 0) to rank 0's `path`; collective.
        `per_rank`: this rank's values for the metadata's record, which rank 0 writes as `with_per_rank` says; they
        travel on the finishing step's gather, so they cost no collective of their own."""
        start = time.perf_counter()
        self.wait()
        per_rank = per_rank or {}
        timing = SaveTiming(blocked_s=0.0)
        self.timings.append(timing)
        if not self.async_save:
            location, partial = prepare_partial_directory(path, group=None)
            with reported_as_save_error(location, partial, self.timeout):
                dcp.save(tensor_state, checkpoint_id=partial.url)
                _finish(partial, location, metadata, per_rank, group=None)
            timing.blocked_s = timing.total_s = time.perf_counter() - start
            return
        group = self._checkpoint_group()
        # In the foreground only what training would otherwise change under the write: the shards, copied into the
        # reused staging buffers, and (rank 0, which writes it) the metadata. Everything else, collectives included
        # (rank 0's path and the partial directory, DCP's planning, the finishing gather), runs in the background.
        try:
            staged = self._staging_buffers().stage(tensor_state)
        except Exception as error:  # e.g. no host memory left for the staging buffers
            raise CheckpointSaveError(
                f"Saving checkpoint {path!r} failed: rank {rank_in(None)} could not copy its shards to CPU memory:"
                f" {type(error).__name__}: {error}. Nothing was written and the previous checkpoint is untouched;"
                " free host memory, or save with `trainer.strategy.async_save = False` (no staging copy)."
            ) from error
        metadata = copy.deepcopy(metadata) if rank_in(None) == 0 else {}
        # Rank 0's own path on rank 0, the rank that removes checkpoints; the others learn it in the background.
        in_flight = _InFlight(Location.parse(path))
        self._in_flight = in_flight

        def write_in_background() -> None:
            try:
                location, partial = prepare_partial_directory(path, group=group)
                with reported_as_save_error(location, partial, self.timeout):
                    dcp.save(staged, checkpoint_id=partial.url, process_group=group)
                    _finish(partial, location, metadata, per_rank, group=group)
                timing.total_s = time.perf_counter() - start
                self._after_publish(in_flight)
                in_flight.done.set_result(None)
            except BaseException as error:
                in_flight.done.set_exception(error)

        timing.blocked_s = time.perf_counter() - start
        self._in_background(write_in_background)

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

    def link(self, target: Location, link: Location, is_global_zero: bool) -> bool:
        """Point `link` at `target` (rank 0; `ModelCheckpoint(save_last="link")`'s `last.ckpt`). While a background
        save is in flight the link is updated only once that save is published, so a kill before then leaves the
        link naming the previous complete checkpoint, never one that was not written. Returns whether the link was
        deferred (the same on every rank: every rank has the same save in flight)."""
        in_flight = self._in_flight
        if in_flight is not None:
            with self._lock:
                if not in_flight.published:
                    in_flight.links.append((target, link))
                    return True
        if is_global_zero:
            point_link(target, link)
        return in_flight is not None

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the in-flight background save (if any) is complete under its final name; re-raise its
        `CheckpointSaveError`. With `timeout_s`, give up waiting after that many seconds (raises `TimeoutError`)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.done.result(timeout=timeout_s)

    def close(self) -> None:
        """Teardown, also after an error: wait for the in-flight save at most the collective timeout plus a margin
        (a rank that stopped responding makes the background collectives fail within the timeout), and log rather
        than raise, so an earlier exception stays the one the user sees. Then end what the writer started: its
        background thread and its process group (a later async save starts both again). Also runs when the process
        exits with a save still in flight (e.g. `trainer.save_checkpoint` after `fit`): a live thread or group at
        interpreter shutdown can abort the process."""
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
            atexit.unregister(self.close)  # the abandoned thread keeps its buffers and group: they go with the process
            return
        except CheckpointSaveError as error:
            log.error(str(error))
        self._release_staging_buffers()
        self._stop_background_thread()
        self._destroy_group()

    def _staging_buffers(self) -> ReusedBufferStager:
        """The stager of every async save of this strategy: it keeps the CPU copies of the shards between saves
        (pinned on GPU machines), so a save copies into memory that is already allocated instead of allocating the
        rank's shard again (`checkpoint.staging`). The copy itself stays synchronous: training may change the
        parameters as soon as `save` returns. Safe to reuse because a save first waits for the previous write."""
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
            self._thread = threading.Thread(target=_run_jobs, args=(self._jobs,), name="dpar-checkpoint", daemon=True)
            self._thread.start()
            atexit.register(self.close)
        self._jobs.put(job)

    def _stop_background_thread(self) -> None:
        """End the thread (its last job is done: `close` waited for it) and the exit hook that would close it."""
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None
            atexit.unregister(self.close)
        if self._thread is not None:
            self._thread.join(timeout=CLOSE_MARGIN_S)
            self._thread = None

    def _destroy_group(self) -> None:
        """Destroy the writer's own process group (the default group's destruction, at exit, would take it too)."""
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._group = None

    def _after_publish(self, in_flight: _InFlight) -> None:
        """Rank 0: point the links that waited for this save, then remove the checkpoints it supersedes."""
        with self._lock:
            in_flight.published = True
            removals, in_flight.removals = in_flight.removals, []
            links, in_flight.links = in_flight.links, []
        if rank_in(None) == 0:
            for target, link in links:
                point_link(target, link)
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


def _finish(
    partial: Location,
    final: Location,
    metadata: dict[str, Any],
    per_rank: dict[str, Any],
    group: dist.ProcessGroup | None,
) -> None:
    """After DCP wrote every rank's data: checksum, gather every rank's checksums and `per_rank` values to rank 0,
    which writes `meta.pt` and renames into place. Collective over `group`."""
    rank = rank_in(group)
    files: dict[str, tuple[int, int]] = {}
    error: str | None = None
    try:
        for name in partial.list_names():
            if is_data_file(name) and name.startswith(f"__{rank}_"):
                files[name] = file_checksum(partial.child(name))
    except OSError as exc:
        error = f"rank {rank} could not read back its shard: {exc}"
    gathered: list[Any] | None = [(files, error, per_rank)]
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size(group) if rank == 0 else None
        dist.gather_object((files, error, per_rank), gathered, dst=0, group=group)  # dst: global rank 0
    problem = None
    if gathered is not None:  # rank 0: every rank's outcome, checksums and values
        problem = next((e for _, e, _ in gathered if e), None)
        if problem is None:
            record = with_per_rank(metadata.get(DPAR_KEY, {}), [values for _, _, values in gathered])
            record["files"] = {name: checksum for rank_files, _, _ in gathered for name, checksum in rank_files.items()}
            problem = write_metadata_and_publish(partial, final, {**metadata, DPAR_KEY: record})
    problem = first_problem(problem, group)  # rank 0 tells every rank how it ended
    if problem is not None:
        raise CheckpointSaveError(f"Saving checkpoint {final.url!r} failed: {problem}.")
