"""Activation checkpointing's step (`lightning_dpar.activation_checkpointing.step`): its slice of the plan from the
strategy's argument (through the planner, as training makes it), the refusal of a value that is no setting, and
the step applied: names and keys unchanged, the blocks recomputed under the plan's policy."""

from __future__ import annotations

import pytest
import torch

from lightning_dpar.activation_checkpointing.step import (
    ActivationCheckpointingPlan,
    apply_activation_checkpointing,
    plan_activation_checkpointing,
)
from lightning_dpar.examples.gpt import GPT
from lightning_dpar.parallel.parallelize import plan_modules
from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.plan import PlanOptions

BLOCKS = ["model.blocks.0", "model.blocks.1"]


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _plan(setting):
    dims = ParallelDims.resolve(world_size=1, devices_per_node=1)
    return plan_modules(_gpt(), dims, PlanOptions("FullyShardStrategy", activation_checkpointing=setting, shards=True))


@pytest.mark.parametrize(
    ("setting", "modules", "policy"),
    [
        (False, [], "full"),
        (True, BLOCKS, "full"),
        ("selective", BLOCKS, "selective"),
        (["model.blocks.1"], ["model.blocks.1"], "full"),
    ],
)
def test_the_planner_makes_the_steps_slice_from_the_argument(setting, modules, policy):
    plan = _plan(setting)
    assert plan.activation_checkpointing == modules
    assert plan.activation_checkpointing_policy == policy


@pytest.mark.parametrize("setting", ["everything", "Selective", 3])
def test_a_value_that_is_no_setting_is_refused_with_the_valid_ones(setting):
    with pytest.raises(ValueError, match=r"activation_checkpointing=.* is not a checkpointing setting") as error:
        plan_activation_checkpointing(_gpt(), setting, lambda spec: [], "FullyShardStrategy")
    assert "'selective'" in str(error.value) and "True" in str(error.value)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_applied_the_step_keeps_names_and_the_gradients_of_the_plain_model(policy):
    plain, checkpointed = _gpt(), _gpt()
    apply_activation_checkpointing(checkpointed, ActivationCheckpointingPlan(BLOCKS, policy))
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    batch = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    for model in (plain, checkpointed):
        model._loss(batch).backward()
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        assert torch.equal(p.grad, q.grad), name
