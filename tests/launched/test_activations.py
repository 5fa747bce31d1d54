"""The activation estimate (`lightning_dpar.estimates.activations`) against real training under tensor parallelism on 2
gloo ranks: the example GPT and a tiny transformers Llama, without and with activation checkpointing, within the 25% the
estimate promises, for what the forward keeps for backward and for the step's peak. One launch."""

from __future__ import annotations

import pytest

from tests.conftest import run_workers


@pytest.fixture(scope="module")
def activations(tmp_path_factory):
    return run_workers(2, "activations", tmp_path_factory.mktemp("activations"))


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", ["no_ac", "ac"])
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_tensor_parallel_estimate_is_within_25_percent_of_the_measured(activations, model, checkpointing):
    if model == "llama":
        pytest.importorskip("transformers")
    result = activations[f"tp2_{model}_{checkpointing}"]
    assert result["checkpointing"] is (checkpointing == "ac")
    for what in ("retained", "peak"):
        estimated, measured = result["estimated"][what], result["measured"][what]
        assert 0.75 <= estimated / measured <= 1.25, (what, estimated, measured)
