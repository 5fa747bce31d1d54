"""Lightning's own launchers: the script re-launch ("popen") and an interactive session (forked ranks)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import WORKERS, run_script


@pytest.mark.slow
@pytest.mark.parametrize("interactive", [False, True], ids=["script_relaunch", "interactive_fork"])
def test_launch_without_torchrun(tmp_path, interactive):
    out = tmp_path / "result.json"
    args = ["-i"] if interactive else []
    proc = run_script([*args, str(WORKERS / "launch_script.py"), str(out)], tmp_path, stdin="" if interactive else None)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["interactive"] is interactive
    assert result["launcher"] == ("InteractiveLauncher" if interactive else "_SubprocessScriptLauncher")
    # Interactive: the parent process's module holds the full trained weights the ranks sent back.
    assert result["max_abs_diff"] < 1e-5
