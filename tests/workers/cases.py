"""Case isolation inside one multi-process launch: each case's result or error, per rank, recorded on its own.

A launch (`torchrun --nproc-per-node N tests/workers/run.py GROUPS OUT`) runs many cases, because starting the
processes and importing Lightning cost more than most cases. Every rank runs the same cases in the same order. A
case is a function run on every rank (`Case`); what it returns on rank 0 is its result, and anything it raises on any
rank is its error, recorded with that rank's traceback. pytest (`tests/conftest.py::run_workers`) then gives each
test its own case's result, or fails that test alone with the case's tracebacks.

The record: every rank appends JSON lines to `OUT/rank<r>.jsonl`, flushed line by line so a dying process leaves
what it did: `{"event": "start", "case": name}` before a case, `{"event": "end", "case": name,
"value": ..., "error": traceback or null, "seconds": ...}` after it, `{"event": "stopped", "reason": ...}` when the
launch stops early, and `{"event": "finished"}` after the last case.

Keeping the ranks in step. After each case every rank waits, on files (`OUT/.sync/`) rather than a collective, until
every other rank has recorded the case's end; then the next case starts on all ranks together. That covers a case
that raised on every rank, or on some ranks after their last collective. A case that raised on some ranks while
the others wait for them inside a collective cannot be resumed: no rank can pull another out of a collective. The
ranks that raised wait `ERROR_GRACE_S` for the others, then mark the launch aborted (`OUT/abort`). Each rank's
watchdog thread sees the mark, records where its rank was stuck (its stack) as this case's error on that rank, and
the launch stops. A case running longer than its `timeout_s` (a hang on every rank) is stopped the same way, with
every rank's stack. pytest then launches again with the cases already recorded skipped (`DPAR_TEST_SKIP_CASES`),
so the cases after a broken one still run and pass or fail on their own. A process that dies in a case without a
record (a segfault, `os.kill`) shows as that case's error ("started, never ended"), and the relaunch continues
after it.

Writing cases: do all the work, collectives included, inside the case's function, so a skipped case skips all of
it; build strategies and modules there too. The runner puts the environment back after each case (a case that seeds
leaves `PL_GLOBAL_SEED` behind, which changes how Lightning's sampler shuffles the next case's data). Return
JSON-serialisable values on rank 0 (other ranks' values are ignored). A case must not depend on an earlier case's
side effects; share an expensive reference run between cases with `functools.cache`, which reruns it in the next
case if it raised.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: How long ranks that raised in a case wait for the others to finish it before declaring the ranks out of step.
ERROR_GRACE_S = 30.0
#: How long a rank that stops the launch waits for the other ranks to record where they were.
ABORT_GRACE_S = 15.0
#: Exit status of a rank whose launch stopped early (the records say why).
STOPPED_EXIT_CODE = 3
SKIP_ENV = "DPAR_TEST_SKIP_CASES"


def _restore_environment(saved: dict[str, str]) -> None:
    """Put `os.environ` back as it was before a case: what a case sets (`seed_everything`'s `PL_GLOBAL_SEED`, which
    Lightning's distributed sampler shuffles with; LightningCLI seeds by default) must not reach the next case, which
    may be another test file's in a shared launch."""
    for name in set(os.environ) - set(saved):
        del os.environ[name]
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


@dataclass(frozen=True)
class Case:
    """One test case of a launch: `fn` runs on every rank; its rank-0 return value is the result named `name`."""

    name: str
    fn: Callable[[], Any]
    timeout_s: float = 300.0


Group = Callable[[], Iterable[Case]]


def one_case(name: str, fn: Callable[[], Any], timeout_s: float = 300.0) -> Group:
    """A group of one case, named like the group."""
    return lambda: [Case(name, fn, timeout_s=timeout_s)]


class CaseRunner:
    """Runs cases on this rank, records them, keeps step with the other ranks and stops the launch if it must."""

    def __init__(self, out_dir: Path, rank: int, world_size: int) -> None:
        self.out_dir, self.rank, self.world_size = out_dir, rank, world_size
        self.sync_dir = out_dir / ".sync"
        self.sync_dir.mkdir(parents=True, exist_ok=True)
        self.abort_file = out_dir / "abort"
        self.record_file = out_dir / f"rank{rank}.jsonl"
        self.skip = {name for name in os.environ.get(SKIP_ENV, "").split(",") if name}
        self._lock = threading.Lock()
        self._current: tuple[int, Case, float] | None = None  # (sequence number, case, start time) while running
        self._stopping = False
        self._sequence = 0
        self._main_thread = threading.main_thread().ident
        threading.Thread(target=self._watchdog, name="case-watchdog", daemon=True).start()

    # ------------------------------------------------------------------ running
    def run_all(self, cases: Iterable[Case]) -> None:
        for case in cases:
            if case.name in self.skip:
                continue
            self.run(case)
        self._record({"event": "finished"})

    def run(self, case: Case) -> None:
        sequence = self._sequence
        self._sequence += 1
        self._record({"event": "start", "case": case.name})
        with self._lock:
            self._current = (sequence, case, time.monotonic())
        started = time.monotonic()
        value, error = None, None
        environment = dict(os.environ)
        try:
            value = case.fn()
            if self.rank == 0:
                value = json.loads(json.dumps(value))  # a value that cannot be recorded is this case's error
            else:
                value = None
        except (Exception, SystemExit):  # SystemExit: e.g. argument parsing inside LightningCLI
            value, error = None, traceback.format_exc()
        finally:
            _restore_environment(environment)
        with self._lock:
            if self._stopping:  # the watchdog stopped the launch while this case ran; it exits the process
                self._block_forever()
            self._current = None
            self._record(
                {"event": "end", "case": case.name, "value": value, "error": error, "seconds": _since(started)}
            )
        (self.sync_dir / f"{sequence}-{self.rank}").touch()
        self._wait_for_peers(sequence, case, raised=error is not None, started=started)

    def _wait_for_peers(self, sequence: int, case: Case, raised: bool, started: float) -> None:
        """Block until every rank recorded the end of case `sequence`; stop the launch if they do not in time."""
        if raised:
            deadline = time.monotonic() + ERROR_GRACE_S
        else:
            deadline = started + case.timeout_s + ERROR_GRACE_S
        while True:
            missing = [r for r in range(self.world_size) if not (self.sync_dir / f"{sequence}-{r}").exists()]
            if not missing:
                return
            if self.abort_file.exists():
                self._exit_after_peers_recorded()
            if time.monotonic() > deadline:
                waited = ERROR_GRACE_S if raised else case.timeout_s + ERROR_GRACE_S
                since = f"rank {self.rank} raised" if raised else f"the case started on rank {self.rank}"
                self._stop(
                    f"case {case.name!r}: ranks {missing} did not finish it within {waited:.0f} s after {since};"
                    " they are probably waiting in a collective for a rank that raised"
                )
            time.sleep(0.05)

    # ------------------------------------------------------------------ stopping
    def _watchdog(self) -> None:
        """Ends this rank when the launch is aborted or its current case overruns, recording where it was."""
        while True:
            time.sleep(0.2)
            with self._lock:
                if self._current is None or self._stopping:
                    continue
                _, case, started = self._current
                if self.abort_file.exists():
                    reason = f"the launch stopped: {self.abort_file.read_text()}"
                elif time.monotonic() - started > case.timeout_s:
                    reason = f"case {case.name!r} timed out after {case.timeout_s:.0f} s on rank {self.rank}"
                    self.abort_file.write_text(reason)
                else:
                    continue
                self._stopping = True
                stack = "".join(traceback.format_stack(sys._current_frames()[self._main_thread]))
                error = f"{reason}\nThis rank was still in the case, at:\n{stack}"
                self._record({"event": "end", "case": case.name, "value": None, "error": error, "seconds": None})
            self._exit_after_peers_recorded()

    def _stop(self, reason: str) -> None:
        if not self.abort_file.exists():
            self.abort_file.write_text(reason)
        self._exit_after_peers_recorded()

    def _exit_after_peers_recorded(self) -> None:
        """Give the other ranks' watchdogs time to record their stacks (torchrun ends them once one rank exits)."""
        self._record({"event": "stopped", "reason": self.abort_file.read_text()})
        deadline = time.monotonic() + ABORT_GRACE_S
        while time.monotonic() < deadline and not all(self._has_stopped(r) for r in range(self.world_size)):
            time.sleep(0.1)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(STOPPED_EXIT_CODE)

    def _has_stopped(self, rank: int) -> bool:
        path = self.out_dir / f"rank{rank}.jsonl"
        text = path.read_text() if path.exists() else ""
        return '"event": "stopped"' in text or '"event": "finished"' in text

    @staticmethod
    def _block_forever() -> None:
        while True:
            time.sleep(60)

    def _record(self, entry: dict) -> None:
        with open(self.record_file, "a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())


def _since(started: float) -> float:
    return round(time.monotonic() - started, 3)
