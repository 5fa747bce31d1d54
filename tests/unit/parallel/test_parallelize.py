"""The list of steps and its two walks: `plan_modules` asks each step for its slice of the plan, `apply_plan` applies
each. In-process, on a one-rank gloo group."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_dpar.parallel import parallelize
from lightning_dpar.parallel.facts import model_facts
from lightning_dpar.steps.contract import Planning
from tests.unit.parallel.test_data_parallel import LightningShaped


def test_the_steps_are_in_torchtitans_order_and_context_parallel_comes_before_checkpointing():
    assert [step.name for step in parallelize.STEPS] == [
        "pipeline split",
        "float8",
        "tensor parallel",
        "loss parallel",
        "expert parallel",
        "context parallel",
        "activation checkpointing",
        "compile",
        "data parallel",
        "materialise",
    ]
    assert [step.name for step in parallelize.STEPS if step.around_step is not None] == [
        "loss parallel",
        "context parallel",
    ]
    assert [step.name for step in parallelize.STEPS if step.around_backward is not None] == ["loss parallel"]
    assert [step.name for step in parallelize.STEPS if step.step_output is not None] == ["loss parallel"]


def test_each_feature_step_is_the_one_its_folder_exports():
    """A feature's step is its folder's `STEP` (issue 42), and step names are unique: each step's result is kept
    under its name (`Applying.results`)."""
    from lightning_dpar.activation_checkpointing import step as activation_checkpointing
    from lightning_dpar.context_parallel import step as context_parallel
    from lightning_dpar.experts import step as experts
    from lightning_dpar.float8 import step as float8
    from lightning_dpar.loss_parallel import step as loss_parallel
    from lightning_dpar.pipeline import step as pipeline

    folders = [pipeline, float8, loss_parallel, experts, context_parallel, activation_checkpointing]
    assert [step for step in parallelize.STEPS if step in {folder.STEP for folder in folders}] == [
        folder.STEP for folder in folders
    ]
    assert len({step.name for step in parallelize.STEPS}) == len(parallelize.STEPS)


def test_apply_plan_walks_every_step_and_the_data_parallel_step_reads_its_settings_from_the_plan(gloo_world):
    """A one-rank `apply_plan` with no strategy: the wrapper and `reshard_after_forward` come from the plan."""
    from lightning_dpar.parallel_dims import ParallelDims
    from lightning_dpar.plan import ModulePlan
    from lightning_dpar.plan.module_plan import DataParallelSettings

    meshes = ParallelDims(1, 1, 1, 1).build_meshes(torch.device("cpu"), device_type="cpu")
    module = LightningShaped()
    settings = DataParallelSettings("fully_shard", reshard_after_forward=False)
    plan = ModulePlan(
        {}, [], ["model.blocks.0", "model.blocks.1"], data_parallel_roots=["model"], data_parallel=settings
    )
    applied = parallelize.apply_plan(module, plan, meshes)
    assert applied.grad_sync_modules == [module.model]
    assert len(applied.fsdp_modules) == 3 and applied.pipeline is None and applied.context_parallel is None
    assert list(applied.results) == [step.name for step in parallelize.STEPS]  # each step's result, by name
    assert applied.results["data parallel"] == applied.grad_sync_modules
    module.model(torch.randn(3, 4)).sum()
    assert not isinstance(module.model.blocks[0].weight, DTensor)  # `reshard_after_forward=False`, from the plan
    assert applied.step_contexts == ()  # no step of this plan does anything around a step
    assert applied.backward_contexts == () and applied.output_steps == ()


def test_around_a_step_the_steps_contexts_are_entered_in_order_and_left_in_reverse():
    from contextlib import contextmanager

    events = []

    def context(name):
        @contextmanager
        def around(training, args):
            events.append(f"enter {name} {training} {args}")
            yield
            events.append(f"exit {name}")

        return around

    applied = parallelize.AppliedPlan(None, nn.Linear(1, 1), [], [], step_contexts=(context("a"), context("b")))
    with applied.around_step(True, (1,)):
        events.append("step")
    assert events == ["enter a True (1,)", "enter b True (1,)", "step", "exit b", "exit a"]
    single = parallelize.AppliedPlan(None, nn.Linear(1, 1), [], [], step_contexts=(context("c"),))
    with single.around_step(False):
        pass
    assert events[-2:] == ["enter c False ()", "exit c"]


def test_around_backward_and_on_the_output_the_steps_parts_run_in_order():
    from contextlib import contextmanager

    events = []

    def context(name):
        @contextmanager
        def around():
            events.append(f"enter {name}")
            yield
            events.append(f"exit {name}")

        return around

    applied = parallelize.AppliedPlan(
        None,
        nn.Linear(1, 1),
        [],
        [],
        backward_contexts=(context("a"), context("b")),
        output_steps=(lambda out: out + 1, lambda out: out * 10),
    )
    with applied.around_backward():
        events.append("backward")
    assert events == ["enter a", "enter b", "backward", "exit b", "exit a"]
    assert applied.step_output(1) == 20


def test_apply_plan_replicates_when_the_plan_says_replicate(gloo_world):
    from lightning_dpar._private_api import is_composable_replicated
    from lightning_dpar.parallel_dims import ParallelDims
    from lightning_dpar.plan import ModulePlan
    from lightning_dpar.plan.module_plan import DataParallelSettings

    meshes = ParallelDims(1, 1, 1, 1).build_meshes(torch.device("cpu"), device_type="cpu")
    module = LightningShaped()
    plan = ModulePlan({}, [], [], data_parallel_roots=["model"], data_parallel=DataParallelSettings("replicate"))
    applied = parallelize.apply_plan(module, plan, meshes)
    assert applied.grad_sync_modules == [module.model] and is_composable_replicated(module.model)
    assert applied.fsdp_modules == []


def _planning(module: nn.Module, dims, **options) -> Planning:
    from lightning_dpar.plan import PlanOptions

    plan_options = PlanOptions("FullyShardStrategy", shards=True, **options)
    return Planning(module, dims, plan_options, model_facts(module, dims, plan_options))


def test_each_field_of_the_plan_is_one_steps_slice_or_a_fact_of_the_model():
    """The planning walk: every `ModulePlan` field but the model-wide ones (`tied`, `adopted`, and `pipeline_rank`,
    set when the plan is restricted to a rank's stages) is made by exactly one step."""
    from dataclasses import fields

    from lightning_dpar.parallel_dims import ParallelDims
    from lightning_dpar.plan import ModulePlan

    planning = _planning(LightningShaped(), ParallelDims(2, 1, 2, 1))
    owners: dict[str, list[str]] = {}
    for step in parallelize.STEPS:
        part = step.plan(planning)
        planning.slices.update(part)
        for name in part:
            owners.setdefault(name, []).append(step.name)
    assert {name: steps for name, steps in owners.items() if len(steps) > 1} == {}
    made = set(owners) | {"tied", "adopted", "pipeline_rank"}
    assert made == {field.name for field in fields(ModulePlan)}
    assert owners["context_parallel"] == ["context parallel"] and owners["data_parallel"] == ["data parallel"]
    assert owners["float8"] == owners["float8_config"] == ["float8"]


def test_plan_modules_is_the_walk_of_the_steps_slices():
    from lightning_dpar.parallel_dims import ParallelDims
    from lightning_dpar.plan import PlanOptions

    module = LightningShaped()
    dims = ParallelDims(2, 1, 2, 1)
    options = PlanOptions("FullyShardStrategy", shards=True, activation_checkpointing=True)
    plan = parallelize.plan_modules(module, dims, options)
    assert plan.shard_units == ["model.blocks.0", "model.blocks.1"]
    assert plan.activation_checkpointing == ["model.blocks.0", "model.blocks.1"]
    assert plan.data_parallel_roots == ["model"] and plan.pipeline is None and plan.tensor_parallel == {}
    assert plan.data_parallel.wrapper == "fully_shard" and not plan.adopted


def test_planning_refuses_before_any_collective_in_the_step_that_owns_the_check():
    """The materialise step's slice refuses a meta-device module it could not initialise shard by shard, with no
    process group started (this test has none)."""
    from lightning_dpar.parallel_dims import ParallelDims

    class Opaque(nn.Module):  # a parameter of its own, no `reset_parameters`: no initialiser to run per shard
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))

    with torch.device("meta"):
        module = nn.Module()
        module.model = nn.Sequential(Opaque(), Opaque())
    planning = _planning(module, ParallelDims(1, 1, 1, 1))
    materialise = next(step for step in parallelize.STEPS if step.name == "materialise")
    with pytest.raises(Exception, match="Opaque"):
        materialise.plan(planning)
