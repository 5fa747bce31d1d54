"""Context parallelism's step (`lightning_dpar.context_parallel.step`): its slice of the plan and the refusals made
with it, and what it does around each step."""

from __future__ import annotations

import pytest
import torch

from lightning_dpar.context_parallel.step import ContextParallelPlan, around_step, plan_context_parallel
from lightning_dpar.parallel_dims import ParallelDims
from tests.unit.context_parallel.test_runtime import Model


def _dims(context: int, pipeline: int = 1) -> ParallelDims:
    return ParallelDims(2 * context * pipeline, 1, 2 * context, 1, pipeline=pipeline, context=context)


def test_no_context_parallelism_is_an_empty_slice_and_checks_nothing():
    assert plan_context_parallel(torch.nn.Linear(2, 2), _dims(1), "whole", "S", [], None) == ContextParallelPlan()


def test_the_slice_names_every_block_in_order():
    part = plan_context_parallel(Model(), _dims(2), "whole", "S", [], None)
    assert part.blocks == ["layers.0", "layers.1"] and part.loss_module is None


def test_the_per_rank_loss_across_pipeline_stages_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"context_parallel_loss='per_rank'\)` is not supported yet.*'whole'"):
        plan_context_parallel(Model(), _dims(2, pipeline=2), "per_rank", "FullyShardStrategy", [], [["a"], ["b"]])


def test_a_checkpointed_module_cutting_a_block_is_refused():
    with pytest.raises(ValueError, match="encloses the blocks"):
        plan_context_parallel(Model(), _dims(2), "whole", "S", ["layers"], None)


class _Runtime:
    def __init__(self) -> None:
        self.entered = 0

    def active(self):
        runtime = self

        class _Active:
            def __enter__(self) -> None:
                runtime.entered += 1

            def __exit__(self, *exc: object) -> None:
                return None

        return _Active()


def test_around_a_training_step_the_batch_is_checked_before_the_sequence_is_split():
    runtime = _Runtime()
    with around_step(runtime, training=True, args=({"attention_mask": torch.ones(1, 4)},)):  # type: ignore[arg-type]
        pass
    assert runtime.entered == 1
    with pytest.raises(ValueError, match="attention_mask"):
        with around_step(runtime, training=True, args=({"attention_mask": torch.zeros(1, 4)},)):  # type: ignore[arg-type]
            pass
    assert runtime.entered == 1  # refused before the split
    with around_step(runtime, training=False, args=({"attention_mask": torch.zeros(1, 4)},)):  # type: ignore[arg-type]
        pass  # evaluation steps are not checked, as before
    assert runtime.entered == 2


def test_the_step_reads_what_it_declares_and_hands_its_hooks_on_by_name():
    """`STEP`, the binding the list of steps walks: the real options, facts and plan satisfy what it declares it
    reads; without context parallelism its slice is empty, its result `None`, and it does nothing around a step."""
    from lightning_dpar.context_parallel import step
    from lightning_dpar.parallel.facts import model_facts
    from lightning_dpar.plan import ModulePlan, PlanOptions
    from lightning_dpar.steps.contract import Applying, Planning

    options = PlanOptions("S", shards=True)
    dims = _dims(1)
    facts = model_facts(Model(), dims, options)
    assert isinstance(options, step.PlanOptionsRead) and isinstance(facts, step.ModelFactsRead)
    planning = Planning(Model(), dims, options, facts, {"pipeline": None})
    assert step.STEP.plan(planning) == {"context_parallel": [], "context_parallel_loss": None}
    plan = ModulePlan({}, [], [])
    assert isinstance(plan, step.ModulePlanRead)
    assert step.STEP.apply(Model(), plan, Applying(meshes=None)) is None  # type: ignore[arg-type]
    assert step.STEP.around_step is not None and step.STEP.around_step(None) is None
    assert step.runtime_of({}) is None and step.checkpoint_contexts({}) is None
    runtime = _Runtime()
    with step.STEP.around_step(runtime)(False, ()):  # type: ignore[misc]
        pass
    assert runtime.entered == 1
    assert step.runtime_of({step.STEP.name: runtime}) is runtime
