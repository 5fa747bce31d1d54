"""The model-zoo conformance matrix: `python -m benchmarks.zoo [--families F ...] [--layouts L ...]`.

Every decoder family whose transformers tensor-parallel plan lightning_dpar claims (a tiny config with the family's
own `tie_word_embeddings`, built locally) under every layout, on 4 CPU gloo ranks. Each cell checks pretrained
weights in, parity with single-process training, resume and `consolidate --format hf` out; it passes, or is refused
before training with a message, or FAILS (`tests/workers/model_zoo.py` defines the checks). One torchrun launch
runs all the cells (the launch machinery of the test suite, `tests/conftest.py`: a cell that crashes or hangs is
recorded as failed and the launch goes on with the next one).

The full matrix (no filters) rewrites the table in `docs/model-zoo.md` between its markers; a filtered run only
prints its table. Needs `transformers` (the `hf` extra) and the test extra (`pytest`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

from tests.conftest import CaseRecord, run_workers
from tests.workers.model_zoo import (
    FAMILIES,
    LAYOUTS,
    WORLD_SIZE,
    cell_name,
    classify,
    launch_args,
    layout_descriptions,
    save_pretrained_dirs,
)

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "model-zoo.md"
BEGIN, END = "<!-- zoo-matrix:begin -->", "<!-- zoo-matrix:end -->"
#: Seconds a launch may take per cell (two fits, the single-process reference, the export) plus its start.
SECONDS_PER_CELL, LAUNCH_SECONDS = 120, 120


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--docs", type=Path, default=DOCS, help="page whose table the full matrix rewrites")
    parser.add_argument("--raw", type=Path, default=None, help="also write every cell's measurements as JSON here")
    return parser.parse_args(argv)


def run_matrix(families: list[str], layouts: list[str], workdir: Path) -> dict[str, CaseRecord]:
    """Every cell's record (rank 0's result, or the failing ranks' tracebacks), by cell name."""
    save_pretrained_dirs(workdir, families)
    cells = [(family, layout) for layout in layouts for family in families]
    groups, env = launch_args(cells)
    timeout = LAUNCH_SECONDS + SECONDS_PER_CELL * len(cells)
    results = run_workers(WORLD_SIZE, groups, workdir, timeout=timeout, extra_env=env)
    missing = CaseRecord(errors={0: f"no record; {results.launches[-1]}"})
    return {cell_name(*cell): results.records.get(cell_name(*cell)) or missing for cell in cells}


def markdown(records: dict[str, CaseRecord], families: list[str], layouts: list[str]) -> str:
    """The matrix as a table (pass / refused / FAILS per cell) followed by each refusal's and failure's message."""
    lines = ["| family | " + " | ".join(f"`{layout}`" for layout in layouts) + " |"]
    lines.append("| --- " * (len(layouts) + 1) + "|")
    notes: list[str] = []
    for family in families:
        cells = []
        for layout in layouts:
            record = records[cell_name(family, layout)]
            verdict, detail = classify(record.value, record.errors)
            if detail:
                notes.append(f"{len(notes) + 1}. {family} under `{layout}`, {verdict}: {_one_line(detail)}")
                verdict = f"{verdict} ({len(notes)})"
            cells.append(f"**{verdict}**" if verdict.startswith("FAILS") else verdict)
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    layout_lines = [f"- `{name}`: {text}" for name, text in layout_descriptions().items() if name in layouts]
    return "\n".join([*lines, "", *layout_lines, "", *_largest(records), "", *notes]) + "\n"


def _largest(records: dict[str, CaseRecord]) -> list[str]:
    """The largest differences the passing cells measured, per check."""
    passed = [r.value for r in records.values() if classify(r.value, r.errors)[0] == "pass"]
    if not passed:
        return []
    worst = {check: max(v[check]["max_abs_diff"] for v in passed) for check in ("loaded", "trained", "resumed")}
    worst["export"] = max(v["export"]["max_abs_diff"] for v in passed)
    return [
        f"Largest differences over the passing cells: parity {worst['trained']:.1e}, pretrained load"
        f" {worst['loaded']:g}, resume {worst['resumed']:.1e}, export {worst['export']:g}."
    ]


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def write_docs(page: Path, table: str, seconds: float) -> None:
    """Replace what lies between the page's markers with the table and how long the run took, where."""
    text = page.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    when = time.strftime("%Y-%m-%d", time.gmtime())
    footer = (
        f"\nLast run {when}: `python -m benchmarks.zoo`, {seconds / 60:.1f} minutes on {platform.machine()} with"
        f" {os.cpu_count()} CPU cores ({WORLD_SIZE} gloo ranks sharing them, on a machine other jobs shared).\n"
    )
    page.write_text(text[:start] + "\n\n" + table + footer + "\n" + text[end:])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zoo-") as tmp:
        records = run_matrix(args.families, args.layouts, Path(tmp))
    seconds = time.monotonic() - started
    table = markdown(records, args.families, args.layouts).replace(tmp, "$WORKDIR")
    print(table)
    print(f"{len(records)} cells in {seconds:.0f} s")
    if args.raw:
        raw = {name: {"value": r.value, "errors": r.errors} for name, r in records.items()}
        args.raw.write_text(json.dumps(raw, indent=1))
    if args.families == list(FAMILIES) and args.layouts == list(LAYOUTS):
        write_docs(args.docs, table, seconds)
        print(f"wrote the table into {args.docs}")
    verdicts = [classify(r.value, r.errors)[0] for r in records.values()]
    return 1 if "FAILS" in verdicts else 0


if __name__ == "__main__":
    sys.exit(main())
