"""The model-zoo conformance matrix's verdicts, in process: `classify` (of `tests/workers/model_zoo.py`) passes a
cell only when every check holds, tells refusals from crashes, and docs/model-zoo.md shows every cell of the current
matrix. The cells themselves, launched on 4 gloo ranks, are in `tests/launched/test_model_zoo.py`. Skipped without
transformers."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers")

from tests.conftest import ROOT
from tests.workers.model_zoo import ATOL, FAMILIES, LAYOUTS, classify


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
