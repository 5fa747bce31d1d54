"""Checkpoints that lose nothing under faults (workers in `tests/workers/checkpoint_faults.py`); the pure "last" rule
behind them is tested in-process in `tests/unit/checkpoint/test_discovery.py`.

- Real SIGKILLs at random moments of async saves, under `save_top_k` 1, 2 and all, `save_last` True and "link",
  saving every step; then `fit(ckpt_path="last")` finishes the run with exactly the uninterrupted parameters.
- A rank that freezes during a save (sync and async) makes the other fail within the timeout, saying why.
- A full disk and a read-only target: every rank raises an error naming the checkpoint and the cause; the previous
  checkpoint stays loadable and nothing partial is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, LaunchResults, run_workers, subprocess_env, workers_command
from tests.workers.checkpoint_common import inputs_env

KILLS = [("top1_last", 11), ("top1_link", 12), ("all_link", 13), ("top2_last", 14)]


def _launch(group: str, out_dir: Path, env: dict[str, str], timeout: float, name: str = "") -> subprocess.Popen:
    """Launch `group` on 2 ranks, saving under `out_dir` (records in `out_dir/<group><name>.records`)."""
    return subprocess.Popen(
        workers_command(2, group, out_dir / f"{group}{name}.records"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**subprocess_env(), **env},
        cwd=ROOT,
        start_new_session=True,  # the whole job can be killed, a stopped rank included
    )


def _finish(proc: subprocess.Popen, timeout: float, worker_pids: list[int] = ()) -> str:
    """Wait for the launch, then kill what is left of it: torchrun's session and the workers (which torchrun starts
    in sessions of their own; a stopped rank would otherwise outlive the test)."""
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        for pid in worker_pids:
            _kill(pid, os.kill)
        _kill(proc.pid, os.killpg)
    if output is None:
        output, _ = proc.communicate(timeout=30)
    return output or ""


def _kill(pid: int, kill) -> None:
    try:
        kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------------- kills at random moments
@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> tuple[Path, dict[str, tuple[int, str]]]:
    """One killed launch per configuration, each saving under `<directory>/<config>`; how each ended."""
    shared = tmp_path_factory.mktemp("kills")
    ended = {}
    for config, seed in KILLS:
        env = {"DPAR_KILL_CONFIG": config, "DPAR_KILL_SEED": str(seed)}
        proc = _launch("faults_kill_random", shared, env, timeout=300, name=f"_{config}")
        output = _finish(proc, timeout=300)
        ended[config] = (proc.returncode, output)
    return shared, ended


@pytest.fixture(scope="module")
def after_kills(killed, tmp_path_factory) -> tuple[dict[str, tuple[int, str]], LaunchResults]:
    """A fresh launch resuming each killed directory, and the "last" rule on a directory of interrupted saves."""
    shared, ended = killed
    inputs = inputs_env(**{config: shared / config for config, _ in KILLS})
    groups = "faults_resume_after_kills,faults_last_without_complete"
    return ended, run_workers(2, groups, tmp_path_factory.mktemp("after_kills"), extra_env=inputs)


@pytest.mark.slow
@pytest.mark.parametrize("config", [config for config, _ in KILLS])
def test_kill_at_random_moment_resumes_exactly_from_newest_complete_checkpoint(after_kills, config):
    killed, results = after_kills
    returncode, output = killed[config]
    assert returncode != 0 and "SIGKILL" in output, output[-3000:]
    result = results[f"kill_{config}"]
    print(f"{config}: left by the kill {result['names_after_kill']}; resumed at step {result['first_step']}")
    # Something complete survived under a final name, and "last" resumed from it rather than from step 0.
    assert [n for n in result["names_after_kill"] if not n.startswith(".") and n.endswith(".ckpt")]
    assert result["first_step"] is not None and result["first_step"] > 0, result
    assert result["max_diff"] == 0.0, result  # bit-identical to the uninterrupted run
    assert not [n for n in result["names_at_end"] if n.startswith(".dpar-")], result


@pytest.mark.slow
def test_last_with_only_interrupted_saves_refuses_to_start_over(after_kills):
    _, results = after_kills
    error = results["last_without_complete"]
    assert error is not None and "CheckpointLoadError" in error
    assert "no complete checkpoint" in error and "last.ckpt" in error and "not restarted from scratch" in error


# ---------------------------------------------------------------------- a frozen rank
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_frozen_rank_during_save_fails_the_others_within_the_timeout(tmp_path, mode):
    timeout_s = 10
    env = {"DPAR_FREEZE_TIMEOUT": str(timeout_s), "DPAR_FREEZE_ASYNC": "1" if mode == "async" else "0"}
    proc = _launch("faults_freeze", tmp_path, env, timeout=240)
    failure_file = tmp_path / "rank0_failure.json"
    deadline = time.time() + 240
    while time.time() < deadline and not failure_file.exists() and proc.poll() is None:
        time.sleep(0.5)
    time.sleep(1.0)  # rank 0's log lines after the failure record
    pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
    for pid in pids:
        _kill(pid, os.kill)
    output = _finish(proc, timeout=30, worker_pids=pids)
    assert failure_file.exists(), output[-4000:]
    frozen_at = float((tmp_path / "frozen_at").read_text())
    failure = json.loads(failure_file.read_text())
    elapsed = failure["failed_at"] - frozen_at
    print(f"{mode}: rank 0 failed {elapsed:.1f} s after rank 1 froze (timeout {timeout_s} s)")
    assert elapsed < timeout_s + 15, (elapsed, output[-4000:])
    assert "stopped responding during the checkpoint write" in failure["error"] + output, output[-4000:]


# ---------------------------------------------------------------------- full and read-only disks
def _mount_tmpfs(path: Path, size: str, read_only: bool = False) -> None:
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {done.stderr.strip()}")


@pytest.fixture(scope="module")
def disk_results(tmp_path_factory):
    shared = tmp_path_factory.mktemp("disks")
    small, read_only = shared / "small", shared / "read_only"
    mounts = [small / "sync", small / "async", read_only]  # a small disk per case: each fills its own
    _mount_tmpfs(small / "sync", "1m")
    _mount_tmpfs(small / "async", "1m")
    _mount_tmpfs(read_only, "1m", read_only=True)
    env = {"DPAR_SMALL_DISK": str(small), "DPAR_READ_ONLY_DISK": str(read_only)}
    try:
        return run_workers(2, "faults_disk_full,faults_read_only", shared, extra_env=env)
    finally:
        for mount in mounts:
            subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_full_disk_raises_on_every_rank_naming_checkpoint_and_cause(disk_results, mode):
    result = disk_results[f"disk_full_{mode}"]
    for error in result["errors"]:
        assert error is not None and "CheckpointSaveError" in error, result
        assert "No space left on device" in error and ".ckpt'" in error, error
        assert "previous checkpoint is untouched" in error
    assert not [n for n in result["names"] if n.startswith(".dpar-")], result["names"]  # nothing partial left
    assert result["validated"] is None, result  # the newest complete checkpoint loads


@pytest.mark.slow
def test_read_only_target_raises_on_every_rank(disk_results):
    for error in disk_results["read_only"]:
        assert error is not None and "CheckpointSaveError" in error and "step=1.ckpt" in error, error
        assert "Read-only file system" in error
