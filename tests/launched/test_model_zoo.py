"""The part of the model-zoo conformance matrix CI runs (the whole matrix: `python -m benchmarks.zoo`, its last result
in docs/model-zoo.md): cells of `tests/workers/model_zoo.py`, each one launch per layout on 4 gloo ranks, every cell
checking pretrained weights in, parity with single-process training, resume and `consolidate --format hf` out. The
verdicts themselves are tested in process in `tests/unit/test_model_zoo.py`."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests.conftest import LaunchResults, run_workers
from tests.workers.model_zoo import (
    FAMILIES,
    WORLD_SIZE,
    cell_name,
    classify,
    launch_args,
    save_pretrained_dirs,
)

TIED = [family for family, spec in FAMILIES.items() if spec.config().tie_word_embeddings]
#: Cells refused by design, with what their message must say.
EXPECTED_REFUSALS = {(family, "dpar_3d"): "pipeline stages cannot share a parameter" for family in TIED}
#: The tensor-parallel headline (the models' own plans, GQA, Qwen3's per-head norms), one launch; slow like the
#: other lane (a 4-rank launch of transformers models is more than the fast lane's budget), the verdicts below stay
#: fast.
FAST = [("llama", "dpar_2d"), ("qwen3", "dpar_2d")]
#: The slow lane, one launch: the plans that differ most under `dpar_2d` (packed projections, gathered q/k/v with
#: full-width norms, a vocabulary-sharded embedding with a renamed head, per-head norms with tied embeddings), the
#: ties, the pipeline's split of an HF model and its refusal of tied embeddings, and one cell of each plan-agnostic
#: layout. The whole matrix: `python -m benchmarks.zoo`.
SLOW = [
    ("llama-tied", "dpar_2d"),
    ("gemma3", "dpar_2d"),
    ("phi3", "dpar_2d"),
    ("gpt-neox", "dpar_2d"),
    ("olmo2", "dpar_2d"),
    ("llama-tied", "dpar_3d"),
    ("phi3", "dpar_3d"),
    ("gemma2", "dpar_fsdp"),
    ("qwen2", "dpar_replicate"),
]


def launch(cells: list[tuple[str, str]], workdir) -> LaunchResults:
    """The records of `cells`, run in one 4-rank launch."""
    save_pretrained_dirs(workdir, sorted({family for family, _ in cells}))
    groups, env = launch_args(cells)
    return run_workers(WORLD_SIZE, groups, workdir, timeout=600, extra_env=env)


@pytest.fixture(scope="module")
def fast(tmp_path_factory) -> LaunchResults:
    return launch(FAST, tmp_path_factory.mktemp("zoo_fast"))


@pytest.fixture(scope="module")
def slow(tmp_path_factory) -> LaunchResults:
    return launch(SLOW, tmp_path_factory.mktemp("zoo_slow"))


def params(cells: list[tuple[str, str]]) -> list:
    return [pytest.param(family, layout, id=f"{family}-{layout}") for family, layout in cells]


def check_cell(results: LaunchResults, family: str, layout: str) -> None:
    """The cell passes, or is refused as `EXPECTED_REFUSALS` says (nothing else)."""
    name = cell_name(family, layout)
    if name not in results:
        results[name]  # fails with the launch's log tail
    record = results.records[name]
    verdict, detail = classify(record.value, record.errors)
    if (family, layout) in EXPECTED_REFUSALS:
        assert verdict == "refused", detail
        assert EXPECTED_REFUSALS[family, layout] in detail
    else:
        assert verdict == "pass", detail


@pytest.mark.slow
@pytest.mark.parametrize(("family", "layout"), params(FAST))
def test_zoo_cell(fast, family, layout):
    check_cell(fast, family, layout)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "layout"), params(SLOW))
def test_zoo_cell_slow(slow, family, layout):
    check_cell(slow, family, layout)
