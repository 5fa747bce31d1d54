"""Bad strategy input through real Trainers on 4 gloo ranks: every rank fails fast with the same message naming
the bad value (cases in `tests/workers/errors.py`; launch: `world4` in `tests/conftest.py`)."""

from __future__ import annotations

import pytest

from tests.conftest import WORLD_GROUPS

ERRORS = {
    "tp_not_dividing_world": ["tensor_parallel_size=5", "does not divide the world size 4", "[1, 2, 4]"],
    "replicate_size_not_dividing": ["replicate_size=5", "Valid replicate sizes: [1, 2, 4]"],
    "pattern_matches_nothing": ["'model.layers.*.fc9' matches no module", "'model.layers.0.fc1'"],
    "style_cannot_shard_module": [
        "ColwiseParallel cannot shard 'model.layers.0' (tests.support.models.Block)",
        "torch.nn.modules.linear.Linear and torch.nn.modules.sparse.Embedding",
    ],
    "tp_without_plan": ["tensor_parallel_size=4", "needs a `tp_plan`"],
    "already_wrapped_ddp": ["'model' is already wrapped in torch.nn.parallel.distributed.DistributedDataParallel"],
    "ddp_knobs_with_tp": ["['static_graph']", "tensor_parallel_size=4"],
}

SHARED_LAUNCH = WORLD_GROUPS  # through the session fixtures `world4`, `world2`, `world1`


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(ERRORS))
def test_bad_input_fails_on_every_rank_with_a_clear_message(world4, case):
    messages = world4[case]
    assert len(messages) == 4 and len(set(messages)) == 1, messages  # every rank, same error, nobody hung
    for fragment in ERRORS[case]:
        assert fragment in messages[0]
