"""The step contract (`lightning_dpar.steps.contract`): what the walks carry, and a step that keeps the contract
without naming any feature, walked as `lightning_dpar.parallel.parallelize` walks `STEPS`."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import FrozenInstanceError
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.steps.contract import Applying, Planning, Step

ONE = ParallelDims(1, 1, 1, 1)


def test_the_walks_state_starts_empty_for_each_walk():
    first, second = Planning(nn.Linear(1, 1), ONE, None, None), Planning(nn.Linear(1, 1), ONE, None, None)
    first.slices["a"] = 1
    assert second.slices == {}
    meshes: Any = object()  # the meshes are only carried here
    applying, other = Applying(meshes), Applying(meshes)
    applying.results["a"] = 1
    assert other.results == {} and applying.materialize and applying.compile_options is None
    assert applying.mixed_precision(True) == MixedPrecisionPolicy()  # FSDP's default: no casting


def test_a_step_without_per_step_parts_costs_nothing_per_step_and_is_frozen():
    step = Step("noop", lambda planning: {}, lambda root, plan, applying: None)
    assert step.around_step is None and step.around_backward is None and step.step_output is None
    with pytest.raises(FrozenInstanceError):
        step.name = "other"  # type: ignore[misc]
    assert step in {step}  # hashable: steps are compared and collected by identity of their parts


def test_a_step_reads_its_options_and_hands_its_result_to_a_later_one_by_name():
    """Two steps keeping the contract: the first plans a slice from the options and records a result, the second
    reads the first's slice while planning and its result while applying, and runs its context around a step only
    where the first's result asks for one."""
    events: list[str] = []

    def plan_scale(planning: Planning) -> Mapping[str, Any]:
        return {"scale": planning.options["scale"]}

    def apply_scale(root: nn.Module, plan: Mapping[str, Any], applying: Applying) -> float:
        with torch.no_grad():
            root.weight.mul_(plan["scale"])
        return plan["scale"]

    def plan_log(planning: Planning) -> Mapping[str, Any]:
        return {"log": planning.slices["scale"] != 1}

    def apply_log(root: nn.Module, plan: Mapping[str, Any], applying: Applying) -> str | None:
        return f"scaled by {applying.results['scale']}" if plan["log"] else None

    def around(message: str | None):
        if message is None:
            return None

        @contextmanager
        def logged(training, args):
            events.append(message)
            yield

        return logged

    steps = (Step("scale", plan_scale, apply_scale), Step("log", plan_log, apply_log, around))
    module = nn.Linear(1, 1, bias=False)
    nn.init.ones_(module.weight)
    planning = Planning(module, ONE, {"scale": 3.0}, facts=None)
    for step in steps:
        planning.slices.update(step.plan(planning))
    applying = Applying(meshes=None)  # type: ignore[arg-type]
    for step in steps:
        applying.results[step.name] = step.apply(module, planning.slices, applying)
    assert module.weight.item() == 3.0 and applying.results == {"scale": 3.0, "log": "scaled by 3.0"}
    contexts = [step.around_step(applying.results[step.name]) for step in steps if step.around_step is not None]
    with contexts[0](True, ()):
        pass
    assert events == ["scaled by 3.0"]
    assert around(None) is None  # a run that needs nothing around a step gets nothing
