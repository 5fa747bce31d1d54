"""Shared test infrastructure: launching the multi-process workers once per world size and handing their results
to many small tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"


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


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    return env


def run_workers(
    nproc: int, groups: str, tmp_path: Path, timeout: int = 420, extra_env: dict[str, str] | None = None
) -> dict:
    """Run `tests/workers/run.py` on `nproc` ranks under torchrun; return rank 0's JSON results."""
    out = tmp_path / f"results_{nproc}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(WORKERS / "run.py"),
        groups,
        str(out),
    ]
    env = {**subprocess_env(), **(extra_env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-80:])
        pytest.fail(f"workers {groups!r} on {nproc} ranks failed (rc={proc.returncode}):\n{tail}")
    return json.loads(out.read_text())


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
