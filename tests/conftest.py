"""Shared test infrastructure: the warning policy, a fake process group for in-process unit tests, and launching
the multi-process workers, whose results many small tests share.

Layout: `tests/unit/<subpackage>/test_<module>.py` run in this process (the fast lane, `-m "not slow"`, is mostly
these); `tests/launched/test_<name>.py` read the results of torchrun launches whose cases are
`tests/workers/<name>.py`; `tests/support/` holds what both share (test models, checkpoint files, hostile payloads,
the conformance harness).

Multi-process tests: `run_workers(nproc, "group,group", tmp_path)` runs the cases of those worker groups in one
torchrun launch (`tests/workers/run.py`; `tests/workers/cases.py` explains how each case is isolated) and returns a
`LaunchResults`. A test reads its case as `results["case_name"]`: the case's rank-0 value, or, if the case raised or
hung on any rank, a failure of that test alone showing each failing rank's traceback (or stack). Cases after one
that stopped the launch run in a relaunch. A new case: a `Case` yielded by a group in the `tests/workers/` module
named like the test file, and a test reading it from a fixture that calls `run_workers`, or, for a file whose cases
can share processes with other files' cases, from `shared_launch(world)` after declaring its groups in
`SHARED_LAUNCH` (see "shared launches" below: one launch per world size for all such files).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.workers.cases import SKIP_ENV

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"

# ---------------------------------------------------------------------------------------------------- warnings
#: Deprecations attributed to the package's own code (torch and Lightning warn with the caller's location) fail the
#: tests, in this process and in every worker: they are the early alarm for the APIs we use.
OUR_MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for p in (ROOT / "lightning_dpar").rglob("*.py")
)
DEPRECATIONS = ("DeprecationWarning", "FutureWarning")
#: Third-party warnings raised at our calls that we cannot act on: (message prefix, category, why).
THIRD_PARTY_IGNORES: list[tuple[str, str, str]] = []


def _error_filters() -> list[str]:
    errors = [f"error::{category}:{module}" for category in DEPRECATIONS for module in OUR_MODULES]
    return errors + [f"ignore:{message}:{category}" for message, category, _ in THIRD_PARTY_IGNORES]


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # One of several test processes (`pytest -n auto`, the fast lane): one intra-op thread each, as the launched
        # workers have (`subprocess_env`), so that the processes share the cores instead of contending for them.
        import torch

        torch.set_num_threads(1)
    # Later entries take precedence (pytest, like Python): the named ignores win over the errors.
    for line in _error_filters():
        config.addinivalue_line("filterwarnings", line)


@pytest.fixture(autouse=True)
def _restore_environment():
    """Undo what a test leaves in `os.environ`: an in-process LightningCLI run sets `PL_GLOBAL_SEED`, which every
    later worker would inherit and use as its distributed sampler's seed, silently changing its data order."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def no_pytest_argv(monkeypatch):
    """Only the `args` given to LightningCLI or `plan` are parsed: pytest's own command line is not the CLI's (and
    LightningCLI warns when both are given)."""
    monkeypatch.setattr(sys, "argv", sys.argv[:1])


@pytest.fixture
def fake_world():
    """`fake_world(world_size, rank=0)`: this process becomes `rank` of a fake process group (torch's `"fake"`
    backend: collectives do nothing), for in-process unit tests that need a `DeviceMesh`; torn down after the test."""
    import torch.distributed as dist

    from lightning_dpar.parallel_dims import init_fake_process_group

    def start(world_size: int, rank: int = 0) -> None:
        init_fake_process_group(rank, world_size)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def gloo_world():
    """This process becomes the only rank of a real gloo process group (world size 1; real collectives), so a
    `Trainer(devices=1)` with a package strategy runs its setup, steps, checkpoints and resume in-process: the
    strategy adopts the existing group instead of starting one. Torn down after the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    # The same policy in workers; `PYTHONWARNINGS` matches module names exactly, hence one entry per module.
    env["PYTHONWARNINGS"] = ",".join(_error_filters())
    return env


@dataclass
class CaseRecord:
    """One case of a launch: rank 0's value, and each failing rank's traceback (or why it left no record)."""

    value: Any = None
    errors: dict[int, str] = field(default_factory=dict)


class LaunchResults(Mapping):
    """The results of one or more worker launches, by case name (see `tests/workers/cases.py`).

    `results[name]` is the case's rank-0 value, or fails the calling test, and only it, with that case's tracebacks
    from every rank where it failed. A name no case recorded fails with the launch's log tail.
    """

    def __init__(self) -> None:
        self.records: dict[str, CaseRecord] = {}
        self.launches: list[str] = []  # a description and log tail of each launch

    def merge(self, other: LaunchResults) -> LaunchResults:
        """Add another launch's cases (for tests that read several launches)."""
        self.records.update(other.records)
        self.launches += other.launches
        return self

    def __getitem__(self, name: str) -> Any:
        record = self.records.get(name)
        if record is None:
            pytest.fail(f"no case recorded a result named {name!r}.\n" + "\n\n".join(self.launches), pytrace=False)
        if record.errors:
            details = "\n".join(f"--- rank {rank} ---\n{error}" for rank, error in sorted(record.errors.items()))
            pytest.fail(f"case {name!r} failed on ranks {sorted(record.errors)}:\n{details}", pytrace=False)
        return record.value

    def __contains__(self, name: object) -> bool:
        return name in self.records

    def __iter__(self) -> Iterator[str]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)


#: Relaunches for the cases after one that stopped a launch (each relaunch costs a process start).
MAX_RELAUNCHES = 4


def torchrun_args(nproc: int, script: Path, *args: str) -> list[str]:
    """The suite's one torchrun command line, after the Python executable: `script args` on `nproc` local ranks."""
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script), *args]


def workers_command(nproc: int, groups: str, out: Path) -> list[str]:
    """The command of one launch of the worker `groups` on `nproc` ranks, recording under `out` (`run_workers`
    runs it; a test that must drive the launch itself, e.g. to kill it, starts this)."""
    return [sys.executable, *torchrun_args(nproc, WORKERS / "run.py", groups, str(out))]


def run_workers(
    nproc: int, groups: str, tmp_path: Path, timeout: int = 420, extra_env: dict[str, str] | None = None
) -> LaunchResults:
    """Run the cases of `groups` on `nproc` ranks under torchrun (`tests/workers/run.py`); return their results.

    A case that stops the launch (ranks out of step, a hang, a dead process) is recorded as failed, and the cases
    after it run in a new launch, so each test sees its own case's outcome. `timeout` bounds each launch.
    """
    results = LaunchResults()
    for attempt in range(MAX_RELAUNCHES + 1):
        out = Path(tempfile.mkdtemp(prefix=f"launch{nproc}-", dir=tmp_path))
        env = {**subprocess_env(), **(extra_env or {}), SKIP_ENV: ",".join(results.records)}
        returncode, log = _run_killing_the_group(workers_command(nproc, groups, out), env, timeout)
        tail = "\n".join(log.splitlines()[-80:])
        results.launches.append(f"launch {attempt} of {groups!r} on {nproc} ranks (rc={returncode}), log tail:\n{tail}")
        recorded_before = len(results.records)
        finished = _read_records(out, nproc, results, log_tail=tail)
        if finished or len(results.records) == recorded_before:
            break  # done, or no progress (e.g. a worker failed at import: every test shows the log tail)
    return results


def _run_killing_the_group(cmd: list[str], env: dict[str, str], timeout: int) -> tuple[int | str, str]:
    """Run `cmd` in its own process group; on timeout kill the whole group (torchrun and every rank)."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            returncode: int | str = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            returncode = f"killed after the launch timeout of {timeout} s"
        log.seek(0)
        return returncode, log.read()


def _read_records(out: Path, nproc: int, results: LaunchResults, log_tail: str) -> bool:
    """Add the launch's case records to `results`; return whether every rank finished every case."""
    finished = True
    for rank in range(nproc):
        path = out / f"rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        events = [json.loads(line) for line in lines if line.strip()]
        finished &= any(e["event"] == "finished" for e in events)
        open_case = None
        for event in events:
            if event["event"] == "start":
                open_case = event["case"]
                results.records.setdefault(open_case, CaseRecord())
            elif event["event"] == "end":
                record = results.records[event["case"]]
                if rank == 0:
                    record.value = event["value"]
                if event["error"] is not None:
                    record.errors[rank] = event["error"]
                open_case = None
        if open_case is not None:  # the process ended inside this case without a word
            results.records[open_case].errors[rank] = (
                f"rank {rank} started case {open_case!r} and ended without a record (killed, or crashed); log tail"
                f" of the launch:\n{log_tail}"
            )
    return finished


# ---------------------------------------------------------------------------------------------------- shared launches
#: A launch costs 7 s (2 ranks) to 11 s (4 ranks) of process start and imports on this 2-core machine, and more
#: for each process's first case, before its own work: test files whose cases need a fresh process of their own
#: (dynamo's caches, memory measured against a baseline) launch alone; the others share one launch per world size.
#: A file lists its worker groups in a module-level `SHARED_LAUNCH = {world: "group,group"}` and reads the launch's
#: results from `shared_launch(world)`. Whichever such file runs first starts the launch with the groups of every
#: file the session collected (`pytest_collection_modifyitems`), so a file run alone launches only its own groups.
SHARED_LAUNCH_GROUPS = pytest.StashKey[dict[int, list[tuple[str, ...]]]]()
#: The timeout of each file's groups in a shared launch (a lone launch's default): a launch sums its files'.
SHARED_LAUNCH_TIMEOUT = 420

#: The launches of test_parity.py, test_features.py, test_errors.py and test_precision.py (each declares all of them,
#: whose cases they read across files) through the session fixtures `world4`, `world2` and `world1`.
WORLD_GROUPS = {
    4: "2d,fsdp,replicate,sync,ignored,plan_sources,fit_then_eval,meta_init,errors,accumulate_no_sync",
    2: "2d,fsdp,replicate,sync,accumulate_no_sync,precision",
    1: "2d,fsdp,replicate",
}


@pytest.hookimpl(trylast=True)  # after `-m` / `-k` deselected what will not run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Gather the `SHARED_LAUNCH` groups of the test files with selected tests, per world size, in collection order."""
    shared: dict[int, list[tuple[str, ...]]] = {}
    seen: set[object] = set()
    for item in items:
        module = getattr(item, "module", None)
        if module is None or module in seen:
            continue
        seen.add(module)
        for world, groups in getattr(module, "SHARED_LAUNCH", {}).items():
            entry = tuple(groups.split(","))
            if entry not in shared.setdefault(world, []):
                shared[world].append(entry)
    config.stash[SHARED_LAUNCH_GROUPS] = shared


@pytest.fixture(scope="session")
def shared_launch(request: pytest.FixtureRequest, tmp_path_factory) -> Callable[[int], LaunchResults]:
    """`shared_launch(world)`: the results of the one launch on `world` ranks of every collected file's groups."""
    declared = request.config.stash.get(SHARED_LAUNCH_GROUPS, {})
    launched: dict[int, LaunchResults] = {}

    def results(world: int) -> LaunchResults:
        if world not in launched:
            files = declared.get(world, [])
            groups = list(dict.fromkeys(group for entry in files for group in entry))
            assert groups, f"no collected test file declares a SHARED_LAUNCH on {world} ranks"
            directory = tmp_path_factory.mktemp(f"shared{world}")
            timeout = SHARED_LAUNCH_TIMEOUT * len(files)
            launched[world] = run_workers(world, ",".join(groups), directory, timeout=timeout)
        return launched[world]

    return results


@pytest.fixture(scope="session")
def world4(shared_launch) -> LaunchResults:
    return shared_launch(4)


@pytest.fixture(scope="session")
def world2(shared_launch) -> LaunchResults:
    return shared_launch(2)


@pytest.fixture(scope="session")
def world1(shared_launch) -> LaunchResults:
    return shared_launch(1)


def run_script(
    args: list[str], tmp_path: Path, timeout: int = 300, stdin: str | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=subprocess_env(),
        cwd=tmp_path,
        input=stdin,
    )
