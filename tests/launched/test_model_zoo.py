"""The part of the model-zoo conformance matrix CI runs (the whole matrix: `python -m benchmarks.zoo`, its last result
in docs/model-zoo.md): cells of `tests/workers/model_zoo.py`, each one launch per layout on 4 gloo ranks, every cell
checking pretrained weights in, parity with single-process training, resume and `consolidate --format hf` out; and
the verdicts themselves, in process."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers")

from tests.conftest import ROOT, LaunchResults, run_workers
from tests.workers.model_zoo import (
    ATOL,
    FAMILIES,
    LAYOUTS,
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


# ---------------------------------------------------------------------- the verdicts, in process
def passing() -> dict:
    exact = {"max_abs_diff": 0.0, "missing": []}
    return {
        "refused": None,
        "tied": True,
        "shared": [["model.lm_head.weight", "model.model.embed_tokens.weight"]],
        "shared_before": [["model.lm_head.weight", "model.model.embed_tokens.weight"]],
        "random_init_diff": 0.1,
        "loaded": dict(exact),
        "trained": {"max_abs_diff": ATOL / 2, "missing": []},
        "resumed": dict(exact),
        "export": {
            "code": 0,
            "names_not_saved": [],
            "names_not_exported": [],
            "missing": [],
            "unexpected": [],
            **exact,
        },
    }


def test_a_cell_passes_only_when_every_check_holds():
    assert classify(passing()) == ("pass", "")
    broken = {  # what goes wrong: what the verdict says
        "loaded": ({"max_abs_diff": 1e-9, "missing": []}, "loaded: max |diff| 1.00e-09"),  # loading must be exact
        "trained": ({"max_abs_diff": 3 * ATOL, "missing": []}, "trained: max |diff| 3.00e-05"),
        "resumed": ({"max_abs_diff": 0.0, "missing": ["model.norm.weight"]}, "resumed: keys missing"),
        "resumed ": ({"max_abs_diff": 1e-4, "missing": []}, "resumed: max |diff| 1.00e-04"),
        "shared": ([], "names sharing a parameter"),  # untied by the parallelisation
        "random_init_diff": (0.0, "the load check would prove nothing"),
    }
    for key, (value, says) in broken.items():
        verdict, detail = classify({**passing(), key.strip(): value})
        assert verdict == "FAILS" and says in detail, (key, detail)
    export = passing()["export"]
    changes = [
        {"unexpected": ["lm_head.weight"]},
        {"max_abs_diff": 1e-7},
        {"code": 1, "error": "no config"},
        {"names_not_saved": ["lm_head.weight"], "names_not_exported": ["embed_out.weight"]},
    ]
    for change in changes:
        assert classify({**passing(), "export": {**export, **change}})[0] == "FAILS", change


def test_refusals_and_crashes():
    refused = {"refused": "ValueError: stages cannot share a parameter", "refused_by": "ValueError"}
    assert classify(refused) == ("refused", refused["refused"])
    own_weights = {"refused": "PretrainedLoadError: keys missing", "refused_by": "PretrainedLoadError"}
    verdict, detail = classify(own_weights)
    assert verdict == "FAILS" and "own save_pretrained directory is refused" in detail
    verdict, detail = classify(None, {2: "Traceback ...\nRuntimeError: boom\n"})
    assert verdict == "FAILS" and detail == "crashed on ranks [2]: RuntimeError: boom"


def test_docs_show_every_cell_of_the_current_matrix():
    page = (ROOT / "docs" / "model-zoo.md").read_text()
    table = page[page.index("<!-- zoo-matrix:begin -->") : page.index("<!-- zoo-matrix:end -->")]
    header = next(line for line in table.splitlines() if line.startswith("| family |"))
    assert re.findall(r"`(\w+)`", header) == list(LAYOUTS)
    rows = {line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")}
    assert set(FAMILIES) <= rows
