"""Optimizers whose update is not elementwise (Muon, Adafactor, LARS-like ones): through real Trainers on 2 and 4
gloo ranks each trains exactly as under Lightning's DDP or is refused on every rank before the first step (cases in
`tests/workers/optimizers.py`); the classification and the probe are unit-tested in-process in
`tests/unit/optim/test_exactness.py`.

Muon is checked on tall, wide, square and odd matrices under FSDP, TP, HSDP and TP x FSDP against torch's own Muon
stepped on the same gradients (bit for bit): its bfloat16 Newton-Schulz turns a last-bit difference of the gradient
(a layout summing it in another order than DDP) into a visible one, so end-to-end parity with DDP is asserted where
the layout sums as DDP does (the `*_muon` cases) and recorded elsewhere."""

from __future__ import annotations

import pytest

from tests.conftest import LaunchResults
from tests.workers.optimizers import MUON_SHAPES

ATOL = 1e-5


# ---------------------------------------------------------------------------------------------------- multi-process
SHARED_LAUNCH = {2: "optimizers", 4: "optimizers4"}


@pytest.fixture(scope="module")
def launch(shared_launch) -> LaunchResults:
    return shared_launch(2)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["replicate_adafactor", "replicate_lars", "fsdp_adamw_vs_ddp", "tp_adamw"])
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
@pytest.mark.parametrize("case", ["fsdp_lars", "tp_lars"])
def test_user_optimizer_exact_through_dtensor_trains_on_shards(launch, case):
    """A LARS written with `p.norm()`: not elementwise, but DTensor takes its norms over the whole tensor."""
    result = launch[case]
    assert result["moved"] > 1e-3
    assert result["max_abs_diff"] < ATOL, result


def _assert_refused_for_reading_shards(errors):
    assert len({e["message"] for e in errors}) == 1, errors  # every rank, the same message, nobody hung
    message = errors[0]["message"]
    assert errors[0]["type"] == "OptimizerLayoutError" and errors[0]["global_step"] == 0
    for fragment in ("LocalLARS", "nor exact on DTensors", "placed as its parameters", "to_local()"):
        assert fragment in message, message
    assert "declare_update_kind" not in message, message  # declaring it elementwise would be wrong


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fsdp_local_lars", "tp_local_lars"])
def test_user_optimizer_reading_its_shards_is_refused_with_the_right_advice(launch, case):
    _assert_refused_for_reading_shards(launch[case])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fsdp_muon", "tp_muon"])
def test_muon_on_shards_trains_exactly_as_under_ddp(launch, case):
    result = launch[case]
    assert result["moved"] > 1e-2  # lr 0.02: Muon's steps are large
    assert result["max_abs_diff"] < ATOL, result


@pytest.mark.slow
@pytest.mark.parametrize("case", [f"{layout}_muon_{shape}" for layout in ("fsdp", "tp") for shape in MUON_SHAPES])
def test_muon_on_shards_steps_as_torch_muon_on_every_matrix_shape(launch, case):
    result = launch[case]
    assert result["moved"] > 1e-2
    assert result["max_abs_diff"] == 0.0, result


@pytest.mark.slow
def test_muon_on_uneven_fsdp_shards_steps_as_torch_muon(launch):
    assert launch["fsdp_muon_odd_rows"]["max_abs_diff"] == 0.0


def _assert_tp_refuses_13(errors):
    """Tensor parallelism cannot split 13 rows over 2 ranks: refused on every rank before a step, by name."""
    assert len({e["message"] for e in errors}) == 1, errors
    assert errors[0]["type"] == "TensorParallelSizeError" and errors[0]["global_step"] == 0, errors[0]
    for fragment in ("`tensor_parallel_size=2`", "out_features=13", "model.fc1"):
        assert fragment in errors[0]["message"], errors[0]["message"]


@pytest.mark.slow
def test_tp_refuses_a_matrix_it_cannot_split_evenly_by_name(launch):
    _assert_tp_refuses_13(launch["tp_muon_odd_rows"])


@pytest.mark.slow
def test_muon_state_resumes_exactly_from_a_sharded_checkpoint(launch):
    assert launch["tp_muon_resume"]["max_abs_diff"] == 0.0


@pytest.fixture(scope="module")
def launch4(shared_launch) -> LaunchResults:
    return shared_launch(4)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["hsdp_muon", "2d_muon"])
def test_muon_on_two_dim_meshes_trains_exactly(launch4, case):
    result = launch4[case]
    assert result["moved"] > 1e-2
    assert result["max_abs_diff"] < ATOL, result


@pytest.mark.slow
@pytest.mark.parametrize("case", ["hsdp_lars", "2d_lars", "pp_fsdp_lars"])
def test_user_optimizer_exact_through_dtensor_on_two_dim_meshes(launch4, case):
    result = launch4[case]
    assert result["moved"] > 1e-3
    assert result["max_abs_diff"] < ATOL, result


@pytest.mark.slow
@pytest.mark.parametrize("case", ["2d_local_lars", "pp_fsdp_local_lars"])
def test_user_optimizer_reading_its_shards_is_refused_on_two_dim_meshes(launch4, case):
    """Under PP 2 x FSDP 2 each stage probes its own mesh; the verdicts are shared, so all 4 ranks raise alike."""
    _assert_refused_for_reading_shards(launch4[case])


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", [*(f"{layout}_muon_{shape}" for layout in ("hsdp", "2d") for shape in MUON_SHAPES), "hsdp_muon_odd_rows"]
)
def test_muon_on_two_dim_meshes_steps_as_torch_muon_on_every_matrix_shape(launch4, case):
    result = launch4[case]
    assert result["moved"] > 1e-2
    assert result["max_abs_diff"] == 0.0, result


@pytest.mark.slow
def test_2d_refuses_a_matrix_tp_cannot_split_evenly_by_name(launch4):
    _assert_tp_refuses_13(launch4["2d_muon_odd_rows"])
