"""Every module of the package is imported, by its full name, by at least one test file (the mirror of the package
is `tests/unit/<folder>/test_<module>.py`): a module no test names is tested only by accident, through others.

`NOT_YET_TESTED_BY_NAME` is the debt this test found when it was written (issue 42); it only shrinks: a module
leaves it when a test file imports it, and a new module without a test file fails here."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = ROOT / "lightning_dpar"

#: Modules no test file imports by name yet (none left since issue 42); a new module needs its test file instead.
NOT_YET_TESTED_BY_NAME: set[str] = set()


def package_modules() -> list[str]:
    """Every module of the package but the packages' `__init__`s and `__main__`."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name not in ("__init__.py", "__main__.py"):
            names.append(".".join(path.relative_to(ROOT).with_suffix("").parts))
    return names


def imported_by_tests(tests: Path = ROOT / "tests") -> set[str]:
    """Every module name a test file imports: `import a.b`, `from a.b import c` (both `a.b` and `a.b.c`)."""
    imported: set[str] = set()
    for path in tests.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return imported


def test_every_module_has_a_test_file_importing_it():
    untested = set(package_modules()) - imported_by_tests()
    assert sorted(untested - NOT_YET_TESTED_BY_NAME) == [], (
        "modules no test file imports: add tests/unit/<folder>/test_<module>.py"
    )
    assert sorted(NOT_YET_TESTED_BY_NAME - untested) == [], "tested now: remove them from NOT_YET_TESTED_BY_NAME"


def test_an_import_from_a_package_names_the_module(tmp_path):
    (tmp_path / "test_x.py").write_text("from lightning_dpar.plan import planner\nimport lightning_dpar.helpers\n")
    assert {"lightning_dpar.plan.planner", "lightning_dpar.helpers"} <= imported_by_tests(tmp_path)
