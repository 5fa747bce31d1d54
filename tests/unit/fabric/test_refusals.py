"""What the Fabric strategies refuse at construction (`lightning_dpar/fabric/refusals.py`), in-process: pure, so
every rank raises the same error before any process group exists."""

from __future__ import annotations

import pytest
from torch import nn

import lightning_dpar.fabric as dpar_fabric
from lightning_dpar.fabric.refusals import TRAINER_ONLY, check_fabric_arguments, check_fabric_model


@pytest.mark.parametrize("name", sorted(TRAINER_ONLY))
def test_each_trainer_only_argument_is_refused_by_name_with_the_fix(name):
    value = 2 if TRAINER_ONLY[name][0] == 1 else object()
    with pytest.raises(ValueError) as error:
        check_fabric_arguments("FullyShardStrategy", {name: value})
    message = str(error.value)
    assert f"lightning_dpar.fabric.FullyShardStrategy({name}=" in message
    assert "cannot run under Fabric" in message
    assert f"lightning_dpar.FullyShardStrategy({name}=" in message  # the fix: the Trainer's strategy
    assert f"leave `{name}` at {TRAINER_ONLY[name][0]!r}" in message


def test_off_values_and_other_arguments_pass():
    check_fabric_arguments("FullyShardStrategy", {name: off for name, (off, _) in TRAINER_ONLY.items()})
    check_fabric_arguments("FullyShardStrategy", {"replicate_size": 2, "tensor_parallel_size": 2})


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: dpar_fabric.FullyShardStrategy(pipeline_parallel_size=2), "pipeline_parallel_size=2"),
        (lambda: dpar_fabric.FullyShardStrategy(context_parallel_size="auto"), "context_parallel_size='auto'"),
        (lambda: dpar_fabric.FSDPTensorParallelStrategy(loss_parallel=True), "loss_parallel=True"),
    ],
)
def test_the_strategies_refuse_when_constructed(make, fragment):
    with pytest.raises(ValueError, match="cannot run under Fabric") as error:
        make()
    assert fragment in str(error.value)


def test_expert_parallelism_is_allowed_under_fabric():
    assert dpar_fabric.FullyShardStrategy(expert_parallel_size=2).engine._expert_parallel_size == 2


def test_float8_is_allowed_under_fabric():
    """Trained in a Fabric loop within float8's noise floor of one process (tests/launched/test_float8.py)."""
    assert "float8" not in TRAINER_ONLY
    pytest.importorskip("torchao.float8")
    assert dpar_fabric.FSDPTensorParallelStrategy(float8="rowwise").engine.plan_options.float8 is not None


def test_a_transformers_moe_returning_router_logits_is_refused_as_the_root_with_the_fix():
    from tests.workers.moe import HFMoEModule

    net = HFMoEModule(output_router_logits=True, router_aux_loss_coef=0.1).net
    with pytest.raises(ValueError, match="with `output_router_logits=True` as the model itself") as error:
        check_fabric_model(net, "FullyShardStrategy")
    assert "Set up a parent module that holds it" in str(error.value)
    check_fabric_model(nn.ModuleDict({"net": net}), "FullyShardStrategy")  # held by a parent: allowed
    check_fabric_model(HFMoEModule().net, "FullyShardStrategy")  # without router logits: allowed


def test_the_trainer_sides_own_checks_run_too():
    with pytest.raises(ValueError, match="reshard_after_forward=0"):
        dpar_fabric.FullyShardStrategy(reshard_after_forward=0)
