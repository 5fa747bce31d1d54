"""Optimizers whose update is not elementwise (Muon, Adafactor, LARS-like ones): through real Trainers on 2 gloo
ranks each trains exactly as under Lightning's DDP or is refused on every rank before the first step (cases in
`tests/workers/optimizers.py`); the classification and the probe are unit-tested in-process in
`tests/unit/test_optimizers.py`."""

from __future__ import annotations

import pytest

from tests.conftest import LaunchResults, run_workers

ATOL = 1e-5


# ---------------------------------------------------------------------------------------------------- multi-process
@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> LaunchResults:
    return run_workers(2, "optimizers", tmp_path_factory.mktemp("optimizers"))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["replicate_adafactor", "replicate_lars", "fsdp_adamw", "tp_adamw"])
def test_replicate_trains_any_optimizer_and_fsdp_adamw_exactly(launch, case):
    result = launch[case]
    assert result["moved"] > 1e-3  # the steps did something
    assert result["max_abs_diff"] < ATOL, result


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fsdp_adafactor", "tp_adafactor"])
def test_adafactor_on_shards_is_refused_before_the_first_step(launch, case):
    errors = launch[case]
    assert len({e["message"] for e in errors}) == 1, errors  # every rank, the same message, nobody hung
    error = errors[0]
    assert error["type"] == "OptimizerLayoutError" and error["global_step"] == 0
    for fragment in ("Adafactor", "rows and columns", "strategy='dpar_replicate'", "elementwise optimizer"):
        assert fragment in error["message"], error["message"]


@pytest.mark.slow
def test_unknown_lars_like_optimizer_is_caught_by_the_probe(launch):
    errors = launch["fsdp_lars"]
    assert len({e["message"] for e in errors}) == 1, errors
    message = errors[0]["message"]
    assert errors[0]["global_step"] == 0
    for fragment in ("LARSLike", "not elementwise", "cut into rows", "declare_update_kind(LARSLike, 'elementwise')"):
        assert fragment in message, message


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fsdp_muon", "tp_muon"])
def test_muon_on_shards_trains_exactly_as_under_ddp(launch, case):
    result = launch[case]
    assert result["moved"] > 1e-2  # lr 0.02: Muon's steps are large
    assert result["max_abs_diff"] < ATOL, result


@pytest.mark.slow
def test_muon_state_resumes_exactly_from_a_sharded_checkpoint(launch):
    assert launch["tp_muon_resume"]["max_abs_diff"] == 0.0


@pytest.fixture(scope="module")
def launch4(tmp_path_factory) -> LaunchResults:
    return run_workers(4, "optimizers4", tmp_path_factory.mktemp("optimizers4"))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["hsdp_muon", "2d_muon"])
def test_muon_on_two_dim_meshes_trains_exactly(launch4, case):
    result = launch4[case]
    assert result["moved"] > 1e-2
    assert result["max_abs_diff"] < ATOL, result
