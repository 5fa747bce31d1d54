"""`UnitCallGuard` (`lightning_dpar.conformance.unit_guard`), in process: a DDP unit whose submodules are called
directly (so DDP would not synchronise its gradients) is an error at the first backward, naming the unit; calling
the unit itself passes, step after step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dpar.conformance.unit_guard import UnitCallGuard


def _unit() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))


def test_calling_the_unit_itself_passes_every_step():
    unit = _unit()
    guard = UnitCallGuard({"model": unit})
    for _ in range(2):
        unit(torch.randn(2, 3)).sum().backward()
        guard.reset()
    assert unit[0].weight.grad is not None


def test_calling_its_submodules_directly_raises_naming_the_unit():
    unit = _unit()
    guard = UnitCallGuard({"model": unit})
    with pytest.raises(RuntimeError, match=r"A parameter of 'model' received a gradient, but the `forward` of 'model'"):
        unit[1](unit[0](torch.randn(2, 3))).sum().backward()
    guard.reset()


def test_a_call_in_an_earlier_step_does_not_cover_the_next_one():
    unit = _unit()
    guard = UnitCallGuard({"model": unit})
    unit(torch.randn(2, 3)).sum().backward()
    guard.reset()
    with pytest.raises(RuntimeError, match="'model'"):
        unit[1](unit[0](torch.randn(2, 3))).sum().backward()


def test_frozen_parameters_and_other_units_are_not_checked():
    unit, other = _unit(), nn.Linear(3, 1)
    unit[0].requires_grad_(False)
    UnitCallGuard({"model": unit})
    other(unit[0](torch.randn(2, 3))).sum().backward()  # only frozen parameters of the unit: nothing to sync
    assert other.weight.grad is not None
