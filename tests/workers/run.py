"""Entry point of the multi-process test workers: `torchrun --nproc-per-node N run.py GROUPS OUT`.

One launch runs the cases of several groups (comma-separated names in GROUPS): starting processes and importing
Lightning dominate the cost of a case. Every rank records each case's result or error under the directory OUT;
`tests/workers/cases.py` describes the records, how a broken case is isolated from the others, and how the ranks
are kept in step. pytest launches this through `tests/conftest.py::run_workers`.

A group is a function returning the `Case`s to run, each case's work inside its function, so that cases already
recorded by an earlier launch (`DPAR_TEST_SKIP_CASES`) are skipped whole.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[0] = str(ROOT)  # the repository, not this directory: no worker module shadows an installed module

from tests.workers.cases import Case, CaseRunner, Group  # noqa: E402

#: One worker module per test file: `tests/workers/<name>.py` holds the cases of `tests/test_<name>.py`.
MODULES = [
    importlib.import_module(f"tests.workers.{name}")
    for name in (
        "parity",
        "features",
        "errors",
        "precision",
        "compile",
        "memory",
        "callbacks",
        "cli",
        "checkpoint",
        "resume_points",
        "checkpoint_reshard",
        "checkpoint_formats",
        "checkpoint_faults",
        "checkpoint_safety",
        "pretrained",
        "moe_weights",
        "plan_apply",
        "hf_models",
        "litgpt_models",
        "pipeline",
        "optimizers",
        "conformance",
        "conformance_callbacks",
        "model_zoo",
        "peft",
        "adapter_checkpoints",
        "ray_train",
        "moe",
        "activations",
        "auto_data",
        "sweep",
        "context_parallel",
        "context_parallel_pipeline",
        "nonfinite",
        "fabric",
        "activation_checkpointing",
        "loss_parallel",
        "float8",
    )
]


GROUPS: dict[str, Group] = {name: group for module in MODULES for name, group in module.GROUPS.items()}


def cases_of(groups: list[str]) -> Iterator[Case]:
    """The cases of `groups`, in order; results are recorded by case name, so two cases of one launch (test files
    share launches: `tests/conftest.py`, shared launches) may not share a name."""
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        raise SystemExit(f"unknown worker groups {unknown}; known: {sorted(GROUPS)}")
    seen: dict[str, str] = {}
    for name in groups:
        for case in GROUPS[name]():
            if case.name in seen:
                raise SystemExit(f"case {case.name!r} of group {name!r} has the name of a case of {seen[case.name]!r}")
            seen[case.name] = name
            yield case


if __name__ == "__main__":
    groups, out = sys.argv[1].split(","), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    runner = CaseRunner(out, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    runner.run_all(cases_of(groups))
