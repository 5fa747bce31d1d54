"""The code base stays lint-clean and formatted (ruff, configured in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff(command):
    proc = subprocess.run([sys.executable, "-m", "ruff", *command], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_each_worker_module_is_named_like_its_test_file():
    """`tests/workers/<name>.py` holds the cases of `tests/launched/test_<name>.py` (see `tests/workers/run.py`), so a
    launched test's cases are found by its file name; the workers' entry point loads every one of them."""
    from tests.workers.run import MODULES

    loaded = {module.__name__.rpartition(".")[2] for module in MODULES}
    # `launch_script` and `fault_tolerance` are scripts torchrun runs directly (one launch per replica group).
    support = {
        "__init__",
        "cases",
        "common",
        "run",
        "checkpoint_common",
        "pipeline_common",
        "context_parallel_per_rank",  # the `context_parallel_loss` group of `context_parallel`, kept apart for size
        "launch_script",
        "fault_tolerance",
    }
    on_disk = {path.stem for path in (ROOT / "tests" / "workers").glob("*.py")} - support
    assert loaded == on_disk, f"not loaded by run.py: {sorted(on_disk - loaded)}; missing: {sorted(loaded - on_disk)}"
    unmatched = sorted(name for name in loaded if not (ROOT / "tests" / "launched" / f"test_{name}.py").exists())
    assert not unmatched, f"worker modules without a test file of the same name: {unmatched}"
