"""Expert parallelism as one step (`lightning_dpar.experts.step`): its slice is the experts modules found with the
model's facts; applying it splits them over the expert mesh (on 2 and 4 gloo ranks: `tests/launched/test_moe.py`)."""

from __future__ import annotations

from lightning_dpar.experts import step
from lightning_dpar.parallel.facts import model_facts
from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.plan import ModulePlan
from lightning_dpar.plan.planner import PlanOptions
from lightning_dpar.steps.contract import Applying, Planning
from tests.unit.experts.test_plan import example_moe

EXPERTS = ["model.blocks.0.mlp.experts", "model.blocks.1.mlp.experts"]


def test_the_slice_is_the_experts_modules_found_with_the_facts():
    dims = ParallelDims.resolve(world_size=2, devices_per_node=2, expert_parallel_size=2)
    options = PlanOptions("FullyShardStrategy", shards=True)
    model = example_moe()
    facts = model_facts(model, dims, options)
    assert isinstance(facts, step.ModelFactsRead)
    part = step.STEP.plan(Planning(model, dims, options, facts))
    assert part == {"experts": EXPERTS} and part["experts"] is not facts.experts  # the plan's own list


def test_a_plan_without_experts_applies_nothing():
    model = example_moe()
    before = [name for name, _ in model.named_parameters()]
    assert step.STEP.apply(model, ModulePlan({}, [], []), Applying(meshes=None)) is None  # type: ignore[arg-type]
    assert [name for name, _ in model.named_parameters()] == before
