"""The part of the model-zoo conformance matrix CI runs (the whole matrix: `python -m benchmarks.zoo`, its last result
in docs/model-zoo.md): cells of `tests/workers/model_zoo.py`, each one launch per layout on 4 gloo ranks, every cell
checking pretrained weights in, parity with single-process training, resume and `consolidate --format hf` out; and
the verdicts themselves, in process."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers")

from tests.conftest import ROOT, run_workers
from tests.workers.model_zoo import (
    ATOL,
    FAMILIES,
    FAMILIES_ENV,
    LAYOUTS,
    WORLD_SIZE,
    cell_name,
    classify,
    save_pretrained_dirs,
)

TIED = [family for family, spec in FAMILIES.items() if spec.config().tie_word_embeddings]
#: Cells refused by design, with what their message must say.
EXPECTED_REFUSALS = {(family, "dpar_3d"): "pipeline stages cannot share a parameter" for family in TIED}
#: Cells that train differently today (xfail strict: when they pass, this entry goes).
KNOWN_FAILURES = {
    (family, "dpar_2d"): "tensor parallelism unties tied embeddings (issue 19; fixed on the `ties` branch)"
    for family in TIED
}
#: The fast lane: the tensor-parallel headline, two cells in one launch.
FAST = {"dpar_2d": ["llama", "qwen3"]}
#: The slow lane: every family under `dpar_2d` (each family's own plan), the pipeline's TP plans and its refusal,
#: and a tied and an untied family under each plan-agnostic layout.
SLOW = {
    "dpar_2d": [f for f in FAMILIES if f not in FAST["dpar_2d"]],
    "dpar_3d": ["llama", "llama-tied", "phi3", "gpt-neox"],
    "dpar_fsdp": ["gemma2", "olmo2"],
    "dpar_replicate": ["llama-tied", "qwen2"],
}


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """`launch(layout, families)`: the records of those cells, run in one 4-rank launch (cached per module)."""
    done = {}

    def run(layout: str, families: list[str]):
        key = (layout, tuple(families))
        if key not in done:
            workdir = tmp_path_factory.mktemp(f"zoo_{layout}")
            save_pretrained_dirs(workdir, families)
            extra_env = {FAMILIES_ENV: ",".join(families)}
            done[key] = run_workers(WORLD_SIZE, f"zoo_{layout}", workdir, timeout=600, extra_env=extra_env)
        return done[key]

    return run


def cells(lanes: dict[str, list[str]], slow: bool) -> list:
    marks = [pytest.mark.slow] if slow else []
    params = []
    for layout, families in lanes.items():
        for family in families:
            cell_marks = list(marks)
            if (family, layout) in KNOWN_FAILURES:
                cell_marks.append(pytest.mark.xfail(reason=KNOWN_FAILURES[family, layout], strict=True))
            params.append(pytest.param(layout, family, families, marks=cell_marks, id=f"{family}-{layout}"))
    return params


def check_cell(launch, layout: str, family: str, families: list[str]) -> None:
    results = launch(layout, families)
    name = cell_name(family, layout)
    record = results.records.get(name)
    if record is None:
        results[name]  # fails with the launch's log tail
    verdict, detail = classify(record.value, record.errors)
    if (family, layout) in EXPECTED_REFUSALS:
        assert verdict == "refused", detail
        assert EXPECTED_REFUSALS[family, layout] in detail
    else:
        assert verdict == "pass", detail


@pytest.mark.parametrize(("layout", "family", "families"), cells(FAST, slow=False))
def test_zoo_cell(launch, layout, family, families):
    check_cell(launch, layout, family, families)


@pytest.mark.parametrize(("layout", "family", "families"), cells(SLOW, slow=True))
def test_zoo_cell_slow(launch, layout, family, families):
    check_cell(launch, layout, family, families)


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
