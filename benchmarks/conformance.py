"""The Lightning conformance matrix: run the conformance tests and write their outcome as a table into the docs.

    python -m benchmarks.conformance                      # every row and column (about 25 minutes on 2 cores)
    python -m benchmarks.conformance -k "dpar_fsdp"       # some cells: only those cells of the table change
    python -m benchmarks.conformance --check              # run, print the table, write nothing

Each test marked `conformance(feature)` and parametrized over `strategy` (`tests/support/conformance_harness.py`) is a
cell: `parity` when it checked the run against Lightning's DDP, `refused` when it checked the refusal (before any
collective, with a message), `failed` when the test failed. Cells whose tests did not run keep their last value.
The table goes between the markers in `docs/lightning-conformance.md`, with the date and the command that made it.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "lightning-conformance.md"
START, END = "<!-- conformance-table:start -->", "<!-- conformance-table:end -->"
#: How a cell reads in the table, by outcome (several tests of one cell: the worst one counts).
RANK = {"failed": 3, "unrecorded": 2, "refused": 1, "parity": 0}
SHOWN = {"parity": "parity", "refused": "refused", "failed": "**failed**", "unrecorded": "passed, no outcome"}


class Collector:
    """A pytest plugin collecting each conformance test's (feature, strategy, outcome)."""

    def __init__(self) -> None:
        self.cells: dict[tuple[str, str], str] = {}
        self.order: list[str] = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: Any, call: Any):
        report = (yield).get_result()
        marker = item.get_closest_marker("conformance")
        params = getattr(getattr(item, "callspec", None), "params", {})
        if marker is None or "strategy" not in params:
            return
        if report.when == "call" and report.passed:
            recorded = [v for k, v in item.user_properties if k == "conformance_outcome"]
            outcome = recorded[-1] if recorded else "unrecorded"
        elif report.failed:
            outcome = "failed"
        else:
            return  # setup/teardown that passed; a skipped test leaves its cell as it was
        self.add(marker.args[0], params["strategy"], outcome)

    def add(self, feature: str, strategy: str, outcome: str) -> None:
        if feature not in self.order:
            self.order.append(feature)
        key = (feature, strategy)
        if key not in self.cells or RANK[outcome] > RANK[self.cells[key]]:
            self.cells[key] = outcome


def read_table(text: str) -> tuple[list[str], list[str], dict[tuple[str, str], str]]:
    """The (rows, columns, cells) of the table between the markers in `text` (empty if there is none)."""
    if START not in text:
        return [], [], {}
    body = text.split(START, 1)[1].split(END, 1)[0]
    lines = [line for line in body.splitlines() if line.startswith("|")]
    if len(lines) < 2:
        return [], [], {}
    columns = [c.strip().strip("`") for c in lines[0].strip("|").split("|")][1:]
    rows, cells = [], {}
    shown_to_outcome = {v: k for k, v in SHOWN.items()}
    for line in lines[2:]:
        parts = [c.strip() for c in line.strip().strip("|").split("|")]
        feature = parts[0].strip("`")
        rows.append(feature)
        for column, value in zip(columns, parts[1:]):
            if value in shown_to_outcome:
                cells[(feature, column)] = shown_to_outcome[value]
    return rows, columns, cells


def render_table(rows: list[str], columns: list[str], cells: dict[tuple[str, str], str]) -> str:
    lines = ["| feature | " + " | ".join(f"`{c}`" for c in columns) + " |"]
    lines.append("|---|" + "---|" * len(columns))
    for feature in rows:
        values = [SHOWN.get(cells.get((feature, c), ""), "not run") for c in columns]
        lines.append(f"| `{feature}` | " + " | ".join(values) + " |")
    return "\n".join(lines)


def update_doc(text: str, collector: Collector, columns: list[str], note: str) -> str:
    old_rows, _, cells = read_table(text)
    cells.update(collector.cells)
    rows = old_rows + [f for f in collector.order if f not in old_rows]
    block = f"{START}\n{note}\n\n{render_table(rows, columns, cells)}\n{END}"
    if START in text:
        return re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    return text.rstrip("\n") + "\n\n" + block + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", dest="keyword", help="pytest -k expression selecting cells")
    parser.add_argument("--check", action="store_true", help="print the table, do not write the docs")
    parser.add_argument("--doc", type=Path, default=DOC, help="the docs page holding the table")
    args = parser.parse_args(argv)

    from tests.support.conformance_harness import STRATEGY_IDS

    collector = Collector()
    pytest_args = ["-q", "-m", "conformance", "-p", "no:cacheprovider", str(ROOT / "tests")]
    if args.keyword:
        pytest_args += ["-k", args.keyword]
    status = pytest.main(pytest_args, plugins=[collector])
    counts = {o: sum(1 for v in collector.cells.values() if v == o) for o in RANK}
    command = "python -m benchmarks.conformance" + (f' -k "{args.keyword}"' if args.keyword else "")
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    note = (
        f"Last run: {today}, `{command}` ({len(collector.cells)} cells: {counts['parity']} parity,"
        f" {counts['refused']} refused, {counts['failed']} failed)."
    )
    text = args.doc.read_text() if args.doc.exists() else ""
    updated = update_doc(text, collector, list(STRATEGY_IDS), note)
    if args.check:
        print(read_table(updated) and updated.split(START, 1)[1].split(END, 1)[0])
    else:
        args.doc.write_text(updated)
        print(f"{note}\nWrote the table into {args.doc}.")
    return 0 if status in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED) and not counts["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
