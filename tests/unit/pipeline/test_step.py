"""Pipeline parallelism's step: its slice of the plan (the split into stages, refused before any collective when it
cannot run) and how it is applied (this rank's stages kept, every other stage's units replaced)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.pipeline.config import PipelineConfig
from lightning_dpar.pipeline.stage import RemoteUnit
from lightning_dpar.pipeline.step import apply_pipeline_split, plan_pipeline_split, rank_stages
from lightning_dpar.plan import repeated_blocks


def _model() -> nn.Module:
    root = nn.Module()
    root.embed = nn.Linear(4, 4)
    root.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])
    root.head = nn.Linear(4, 2)
    return root


def test_no_pipeline_no_split():
    model = _model()
    assert plan_pipeline_split(model, ParallelDims(2, 1, 2, 1), None, repeated_blocks(model)) is None
    assert rank_stages(None, 0) is None
    assert apply_pipeline_split(model, None, 0, torch.device("cpu")) is None


def test_the_split_gives_each_rank_its_stages_and_replaces_the_others_units():
    model = _model()
    config = PipelineConfig.of("1F1B", None, 1, None)
    split = plan_pipeline_split(model, ParallelDims(2, 1, 1, 1, pipeline=2), config, repeated_blocks(model))
    assert split is not None
    assert split.stages == (("embed", "layers.0", "layers.1"), ("layers.2", "layers.3", "head"))
    assert rank_stages(split, 1) == [("layers.2", "layers.3", "head")]
    pipelined = apply_pipeline_split(model, split, 1, torch.device("meta"))
    assert pipelined is not None
    assert isinstance(model.embed, RemoteUnit) and isinstance(model.get_submodule("layers.0"), RemoteUnit)
    assert isinstance(model.head, nn.Linear)


def test_a_schedule_the_pipeline_size_cannot_run_is_refused_before_any_collective():
    model = _model()
    config = PipelineConfig.of("1F1B", 1, 1, None)  # one microbatch for two stages
    with pytest.raises(ValueError, match=r"`pipeline_microbatches=1` for 2 stages"):
        plan_pipeline_split(model, ParallelDims(2, 1, 1, 1, pipeline=2), config, repeated_blocks(model))


def test_the_step_plans_the_split_and_hands_its_stages_on_by_name():
    """`STEP`, the binding the list of steps walks: its slice from the options and the model's units, the BatchNorm
    refusal first, and this rank's stages as its result, which `pipelined` reads back."""
    from lightning_dpar.parallel.facts import model_facts
    from lightning_dpar.pipeline import step
    from lightning_dpar.plan import ModulePlan, PlanOptions
    from lightning_dpar.steps.contract import Applying, Planning

    dims = ParallelDims(2, 1, 1, 1, pipeline=2)
    options = PlanOptions("S", shards=True, pipeline=PipelineConfig.of("1F1B", None, 1, None))
    model = _model()
    facts = model_facts(model, dims, options)
    assert isinstance(options, step.PlanOptionsRead) and isinstance(facts, step.ModelFactsRead)
    split = step.STEP.plan(Planning(model, dims, options, facts))["pipeline"]
    assert split.stages == (("embed", "layers.0", "layers.1"), ("layers.2", "layers.3", "head"))
    plan = ModulePlan({}, [], [], pipeline=split, pipeline_rank=1)
    assert isinstance(plan, step.ModulePlanRead)
    applying = Applying(meshes=None, materialize=False)  # type: ignore[arg-type]  # the dry run: the meta device
    applying.results[step.STEP.name] = step.STEP.apply(model, plan, applying)
    assert step.pipelined(applying.results) is applying.results["pipeline split"]
    assert isinstance(model.embed, RemoteUnit) and step.pipelined({}) is None
    normed = _model()
    normed.norm = nn.BatchNorm1d(4)
    with pytest.raises(ValueError, match="BatchNorm"):
        step.STEP.plan(Planning(normed, dims, options, facts))
