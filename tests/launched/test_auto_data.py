"""`dpar_auto` reads the batch where Lightning reads the training data (the module's own `train_dataloader()`, a
data module's, a `DataLoader` given to `fit` with `global_batch_size=`), through real Trainers on 2 and 4 gloo ranks
(cases in `tests/workers/auto_data.py`): it trains the global batch the data implies, at parity with one process,
and refuses what it cannot read or make on every rank, naming what to set."""

from __future__ import annotations

import pytest

from tests.workers.auto_data import GLOBAL

ATOL = 1e-5


SHARED_LAUNCH = {2: "auto_data", 4: "auto_data"}


@pytest.fixture(scope="module")
def data2(shared_launch):
    return shared_launch(2)


@pytest.fixture(scope="module")
def data4(shared_launch):
    return shared_launch(4)


@pytest.mark.slow
@pytest.mark.parametrize("world", ["data2", "data4"])
@pytest.mark.parametrize("case", ["module_loader", "datamodule_loader"])
def test_a_loader_sized_from_the_sampler_trains_the_global_batch_of_the_chosen_layout(world, case, request):
    result = request.getfixturevalue(world)[case]
    # The sampler Lightning built the loader with saw the chosen data-parallel size, so each rank trained its share.
    assert result["sampler_replicas"] == result["data_parallel"]
    assert result["steps"] == 3
    assert result["batch_sizes"] == [GLOBAL // result["data_parallel"]] * 3
    assert result["vs_single"] < ATOL
    if case == "datamodule_loader":  # 1 layer: no pipeline, so each of several data-parallel ranks trains a share
        assert result["data_parallel"] > 1


@pytest.mark.slow
@pytest.mark.parametrize("world", ["data2", "data4"])
def test_a_global_batch_with_a_fixed_loader_chooses_the_data_parallel_size_it_implies(world, request):
    result = request.getfixturevalue(world)["global_with_loader"]
    assert result["data_parallel"] == 2  # 8 sequences per step over loaders of 4
    assert result["batch_sizes"] == [GLOBAL // 2] * 3
    assert result["vs_single"] < ATOL


@pytest.mark.slow
@pytest.mark.parametrize("world", ["data2", "data4"])
def test_a_global_batch_the_loader_cannot_make_is_refused_naming_the_values_and_the_fix(world, request):
    message = request.getfixturevalue(world)["global_loader_mismatch"]
    assert "batch_size=4" in message and "multiple of 4" in message
    assert "global_batch_size=4" in message or "global_batch_size=8" in message  # a valid one is named


@pytest.mark.slow
@pytest.mark.parametrize("world", ["data2", "data4"])
def test_a_loader_that_cannot_be_read_before_setup_is_refused_naming_what_to_set(world, request):
    message = request.getfixturevalue(world)["loader_needs_setup"]
    assert "SetupLoaderGPT.train_dataloader()" in message and "AttributeError" in message
    assert "`global_batch_size=`" in message and "`batch_size=`" in message
