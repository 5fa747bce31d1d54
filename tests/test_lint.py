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
