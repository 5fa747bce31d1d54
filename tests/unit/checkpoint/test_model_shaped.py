"""Model-shaped checkpoint entries (`lightning_dpar.checkpoint.model_shaped`), in-process: a weight-averaging
callback's model-keyed state goes to DCP and is found again on load. The callbacks' resumes through real Trainers are
the conformance matrix's callback rows (cases in `tests/workers/conformance_callbacks.py`, the matrix in
`tests/launched/test_conformance_callbacks.py`)."""

from __future__ import annotations

import torch

from lightning_dpar.checkpoint.model_shaped import SHARDED_ENTRY, marked_entries
from lightning_dpar.checkpoint.sharded import split_checkpoint


def test_model_shaped_checkpoint_entries_go_to_dcp_and_are_found_again():
    weights = {"a.weight": torch.ones(2), "a.bias": torch.zeros(1)}
    checkpoint = {
        "state_dict": weights,
        "current_model_state": dict(weights),  # WeightAveraging's set-aside training weights
        "averaging_state": {"n_averaged": torch.tensor(3)},  # not keyed like the model: stays in meta.pt
        "callbacks": {"StochasticWeightAveraging{'swa_lrs': 0.1}": {"average_model_state": dict(weights), "n": 1}},
        "optimizer_states": [],
    }
    tensor_state, metadata = split_checkpoint(checkpoint)
    assert set(tensor_state) == {"state_dict", "current_model_state", "callback_state_0"}
    assert metadata["current_model_state"] == {SHARDED_ENTRY: "current_model_state"}
    assert metadata["averaging_state"]["n_averaged"].item() == 3
    swa_state = metadata["callbacks"]["StochasticWeightAveraging{'swa_lrs': 0.1}"]
    assert swa_state == {"average_model_state": {SHARDED_ENTRY: "callback_state_0"}, "n": 1}
    assert "average_model_state" in next(iter(checkpoint["callbacks"].values()))  # the callback's dict untouched
    assert sorted(key for _, _, key in marked_entries(metadata)) == ["callback_state_0", "current_model_state"]
