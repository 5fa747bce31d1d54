"""`benchmarks/step_hooks.py`, the per-step hook costs: a tiny real run (one gloo rank, in this process) that keeps
the command working, and the timers' bookkeeping."""

from __future__ import annotations

import importlib

import pytest

from benchmarks.step_hooks import HOOKS, Timers, hooks_timed, main, markdown


def _originals() -> list[object]:
    found = []
    for module_name, class_name, attr in HOOKS:
        owner = importlib.import_module(module_name)
        found.append(getattr(owner, class_name).__dict__[attr] if class_name else getattr(owner, attr))
    return found


def test_every_hook_is_timed_and_put_back():
    before = _originals()
    timers = Timers()
    with hooks_timed(timers):
        assert all(now is not then for now, then in zip(_originals(), before))
    assert all(now is then for now, then in zip(_originals(), before))


@pytest.mark.slow  # three Trainers (about 5 s quiet, 30 s on a loaded 2-core machine)
def test_a_short_run_writes_every_strategys_column(tmp_path):
    main(["--steps", "3", "--warmup", "1", "--out", str(tmp_path)])
    table = (tmp_path / "step_hooks_cpu.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| |"))
    assert header == "| | dpar_fsdp | dpar_replicate | dpar_2d |"
    rows = {line.split(" | ")[0]: line for line in table.splitlines() if line.startswith("| `")}
    # Hooks every strategy runs each step, with a call count of 1 per step.
    for hook in ("StepHooks._release_last_gradients", "StepHooks._step_forward", "data_parallel.reshard"):
        assert rows[f"| `{hook}`"].count("| 1: ") == 3, rows[f"| `{hook}`"]
    assert "UnitCallGuard._check_called" in table  # DDP's guard, on the replicate column only


def test_the_table_on_known_numbers(monkeypatch):
    results = {
        "a": {"step_us": 1000.0, "hooks": {"x": (1.0, 5.0), "y": (2.0, 5.0), "LightningModule.z": (1.0, 7.0)}},
        "b": {"step_us": 2000.0, "hooks": {"x": (1.0, 10.0)}},
    }
    monkeypatch.setattr("benchmarks.step_hooks.OURS", {"x", "y"})
    table = markdown(results, steps=4)
    assert "| `x` | 1: 5.0 | 1: 10.0 |" in table  # (hooks outside `OURS` are listed, not summed)
    assert "| `y` | 2: 5.0 |  |" in table
    assert "| `LightningModule.z` | 1: 7.0 |  |" in table
    assert "| the package's hooks (us) | 10.0 | 10.0 |" in table
    assert "| share of the step | 1.00% | 0.50% |" in table
