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


def _sharded_gpt(policy: str | None) -> GPT:
    """The GPT with each block (then the root) under `fully_shard` in bf16 mixed precision, as the strategies wrap
    it, its blocks checkpointed first under `policy` (`None`: not checkpointed)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _gpt()
    if policy is not None:
        apply_activation_checkpointing(model, ActivationCheckpointingPlan(BLOCKS, policy))
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for fqn in BLOCKS:
        fully_shard(model.get_submodule(fqn), mp_policy=mixed)
    fully_shard(model, mp_policy=mixed)
    return model


def test_selective_checkpointing_under_fsdp_mixed_precision_recomputes_what_its_forward_ran(gloo_world):
    """FSDP2's pre-forward hook casts a unit's inputs under `record_function`, outside the checkpointed forward; the
    recomputation must not run it again inside the policy's replay (which refused it: "profiler._record_function_
    enter_new.default encountered during backward but not found in storage"). In bf16 the gradients are those of
    the same model without checkpointing and with full checkpointing, bit for bit: the same ops, the same inputs."""
    batch = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    grads = {}
    for policy in (None, "full", "selective"):
        model = _sharded_gpt(policy)
        model._loss(batch).backward()
        grads[policy] = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    for name, grad in grads[None].items():
        assert torch.equal(grads["selective"][name], grad), name
        assert torch.equal(grads["full"][name], grad), name


def test_a_deep_copy_of_a_selectively_checkpointed_model_computes_with_its_own_parameters():
    """Weight averaging deep-copies the model: the copy's checkpointed forward is bound to the copy."""
    import copy

    model = _gpt()
    apply_activation_checkpointing(model, ActivationCheckpointingPlan(BLOCKS, "selective"))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    batch = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    plain = _gpt()
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(0.5)
    assert torch.equal(twin._loss(batch), plain._loss(batch))
    assert not torch.equal(model._loss(batch), twin._loss(batch))


def test_the_step_takes_its_slice_from_the_facts_and_applies_it():
    """`STEP`, the binding the list of steps walks: its slice is the recomputed modules found with the model's facts,
    and applying it (no context parallelism: no checkpoint contexts to take) recomputes those modules."""
    from lightning_dpar.activation_checkpointing import step
    from lightning_dpar.parallel.facts import model_facts
    from lightning_dpar.plan import ModulePlan
    from lightning_dpar.steps.contract import Applying, Planning

    dims = ParallelDims(2, 1, 2, 1)
    options = PlanOptions("FullyShardStrategy", shards=True, activation_checkpointing="selective")
    model = _gpt()
    facts = model_facts(model, dims, options)
    assert isinstance(facts, step.ModelFactsRead)
    part = step.STEP.plan(Planning(model, dims, options, facts))
    assert part == {"activation_checkpointing": BLOCKS, "activation_checkpointing_policy": "selective"}
    plan = ModulePlan({}, part["activation_checkpointing"], [], activation_checkpointing_policy="selective")
    assert isinstance(plan, step.ModulePlanRead)
    forward = type(model.model.blocks[0]).forward
    step.STEP.apply(model, plan, Applying(meshes=None))  # type: ignore[arg-type]
    assert model.model.blocks[0].forward is not forward  # the selective policy checkpoints the block's forward
