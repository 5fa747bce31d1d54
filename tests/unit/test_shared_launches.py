"""The test suite's shared launches (`tests/conftest.py`): one launch per world size runs the worker groups of every
test file that declares a `SHARED_LAUNCH`, and results are recorded by case name. Two groups of one launch with a
case of the same name stop that whole launch, failing every test file in it; this finds such a clash in the fast
lane, on the groups the full suite launches together, without starting a process."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

LAUNCHED = Path(__file__).resolve().parents[1] / "launched"


def declared_launches() -> dict[int, list[str]]:
    """The groups of each world size's shared launch when the whole suite is collected, as `tests/conftest.py` joins
    them (every test file's groups, in file order, each group once)."""
    launches: dict[int, list[str]] = {}
    for path in sorted(LAUNCHED.glob("test_*.py")):
        try:
            module = importlib.import_module(f"tests.launched.{path.stem}")
        except pytest.skip.Exception:  # an optional dependency is missing: the suite does not collect this file
            continue
        for world, groups in getattr(module, "SHARED_LAUNCH", {}).items():
            launches.setdefault(world, [])
            launches[world] += [group for group in groups.split(",") if group not in launches[world]]
    return launches


@pytest.fixture
def worker_groups(monkeypatch):
    """`tests.workers.run.cases_of`, imported with this process's `sys.path` restored afterwards (the entry point puts
    the repository first on it)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    return importlib.import_module("tests.workers.run").cases_of


@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_groups_of_a_shared_launch_have_no_two_cases_of_one_name(world, worker_groups, monkeypatch):
    groups = declared_launches()[world]
    assert len(groups) > 1  # the suite shares launches on this world size: the check has something to find
    monkeypatch.setenv("WORLD_SIZE", str(world))  # groups choose their cases by the launch's world size
    try:
        names = [case.name for case in worker_groups(groups)]
    except SystemExit as clash:
        pytest.fail(f"the shared launch on {world} ranks would stop before its first case: {clash}")
    assert len(names) == len(set(names))
