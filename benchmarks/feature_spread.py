"""How far each feature reaches outside its folder: `python -m benchmarks.feature_spread [--root DIR]`.

For each feature (context parallelism, experts, pipeline parallelism, fault tolerance, activation checkpointing, loss
parallelism) it counts the code lines of the package outside the feature's own folder that name the feature, and the
files they are in. A code line is a line of Python with its comments and docstrings removed (an error message's
string is code: it names the feature to the user). A feature that lives in its folder shows up elsewhere only as
its step in the list of steps, its mesh dim in `ParallelDims` and its options; the table says how close the package
is to that (issue 42): of the lines outside, how many sit in those places (`allowed_lines`) and how many elsewhere
(the goal: a handful).

`--root` points at another checkout's `lightning_dpar/` (to measure `main` before a change).
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: This checkout's package (read as text: nothing is imported, so the count takes a second).
PACKAGE = Path(__file__).resolve().parents[1] / "lightning_dpar"

#: Feature -> (its folder, the pattern a line naming it matches; case-insensitive).
FEATURES: dict[str, tuple[str, str]] = {
    "context parallel": ("context_parallel", r"context_parallel|contextparallel|\.context\b|\bcontext=|\bCONTEXT\b"),
    "experts": ("experts", r"expert|router_loss|\bmoe\b"),
    "pipeline": ("pipeline", r"pipelin|\bstages?\b|stage_|_stages?\b"),
    "fault tolerance": ("fault_tolerance", r"fault_toleran|faulttoleran|torchft|replica_group"),
    "activation checkpointing": (
        "activation_checkpointing",
        r"activation_checkpoint|checkpoint_activations|checkpointing_policy|\bselective\b|recompute",
    ),
    "loss parallel": ("loss_parallel", r"loss_parallel|lossparallel"),
    "float8": ("float8", r"float8"),
}


#: Where issue 42 lets a feature appear outside its folder, by the package-relative file: its mesh dimension
#: (`parallel_dims.py`, which owns sizes and meshes), its step in the list (`STEPS`), and its options (a strategy's
#: constructor and the `plan_options` it freezes them into, `PlanOptions`, a command line's `add_argument`s).
OPTION_FUNCTIONS = ("__init__", "plan_options")
OPTION_FOLDERS = ("strategies", "fabric", "layout_search")


@dataclass(frozen=True)
class Spread:
    """The code lines outside a feature's folder that name it, per file (`{relative path: lines}`), and how many of
    them are where the issue allows a feature to appear (`allowed`: its mesh dimension, its step, its options)."""

    feature: str
    files: dict[str, int]
    allowed: int = 0

    @property
    def lines(self) -> int:
        return sum(self.files.values())


def code_lines(source: str) -> Iterator[tuple[int, str]]:
    """`(line number, code)` for each line holding code once comments and docstrings (a string that is a whole
    statement) are removed; the code is the line's remaining tokens joined by spaces."""
    kept: dict[int, list[str]] = {}
    previous = tokenize.NEWLINE
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        kind = token.type
        if kind in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT):
            if kind != tokenize.COMMENT and kind != tokenize.NL:
                previous = kind
            continue
        if kind == tokenize.ENDMARKER:
            break
        docstring = kind == tokenize.STRING and previous in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
        previous = kind
        if docstring:
            continue
        for line in range(token.start[0], token.end[0] + 1):
            kept.setdefault(line, []).append(token.string)
    for number in sorted(kept):
        yield number, " ".join(kept[number])


def allowed_lines(relative: Path, source: str) -> set[int]:
    """The lines of the module at `relative` (package-relative) where a feature may appear (`OPTION_FUNCTIONS` of
    the classes of `OPTION_FOLDERS`, `PlanOptions`, `add_argument` calls, the `STEPS` list, all of
    `parallel_dims.py`)."""
    if relative == Path("parallel_dims.py"):
        return set(range(1, source.count("\n") + 2))
    spans: list[ast.AST] = []
    options_folder = relative.parts[0] in OPTION_FOLDERS
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == "PlanOptions":
            spans.append(node)
        elif isinstance(node, ast.ClassDef) and options_folder:
            spans += [f for f in node.body if isinstance(f, ast.FunctionDef) and f.name in OPTION_FUNCTIONS]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            spans.append(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(target, ast.Name) and target.id == "STEPS" for target in targets):
                spans.append(node)
    return {line for node in spans for line in range(node.lineno, (node.end_lineno or node.lineno) + 1)}


def feature_spread(root: Path) -> list[Spread]:
    """Each feature's `Spread` over the package at `root` (its `lightning_dpar/` folder)."""
    sources = {path: path.read_text() for path in sorted(root.rglob("*.py"))}
    spreads = []
    for feature, (folder, pattern) in FEATURES.items():
        regex = re.compile(pattern, re.IGNORECASE)
        files: dict[str, int] = {}
        allowed = 0
        for path, source in sources.items():
            relative = path.relative_to(root)
            if relative.parts[0] == folder:
                continue
            naming = [number for number, code in code_lines(source) if regex.search(code)]
            if naming:
                files[str(relative)] = len(naming)
                allowed += len(set(naming) & allowed_lines(relative, source))
        spreads.append(Spread(feature, files, allowed))
    return spreads


def render(spreads: list[Spread], detail: bool = False) -> str:
    """A markdown table: per feature, the code lines outside its folder that name it and the files they are in."""
    rows = [
        "| feature | code lines outside its folder | files | of them its mesh dim, step or options | elsewhere |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    rows += [f"| {s.feature} | {s.lines} | {len(s.files)} | {s.allowed} | {s.lines - s.allowed} |" for s in spreads]
    if detail:
        for spread in spreads:
            rows.append(f"\n{spread.feature}:")
            rows += [f"  {count:4d}  {path}" for path, count in sorted(spread.files.items(), key=lambda kv: -kv[1])]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=PACKAGE, help="a lightning_dpar/")
    parser.add_argument("--detail", action="store_true", help="also list the files, most lines first")
    args = parser.parse_args(argv)
    print(render(feature_spread(args.root), args.detail))


if __name__ == "__main__":
    main()
