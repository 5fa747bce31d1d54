"""Fabric's save/load state mapped onto the Trainer's checkpoint layout, and an optimizer re-pointed at a parallel
model's parameters (`lightning_dpar/fabric/state.py`), in-process: pure logic on real modules and optimizers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dpar.fabric.state import rebind_optimizer, split_state


def test_split_state_finds_the_model_the_optimizers_in_order_and_the_rest():
    model = nn.Linear(2, 2)
    first, second = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.Adam(model.parameters())
    split = split_state({"step": 3, "opt_b": second, "model": model, "opt_a": first, "note": "x"}, "S")
    assert split.model_key == "model" and split.model is model
    assert split.optimizers == [("opt_b", second), ("opt_a", first)]  # the state's order: optimizer_states' order
    assert split.rest == {"step": 3, "note": "x"}


@pytest.mark.parametrize("models", [0, 2])
def test_split_state_refuses_other_than_one_model(models):
    state = {f"m{i}": nn.Linear(1, 1) for i in range(models)}
    with pytest.raises(ValueError, match=f"has {models} modules") as error:
        split_state(state, "FullyShardStrategy")
    assert "`FullyShardStrategy` saves and loads one model" in str(error.value)


def test_rebind_points_every_group_at_the_parameters_of_the_same_name():
    before, after = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)), nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    optimizer = torch.optim.SGD(
        [{"params": before[0].parameters()}, {"params": before[1].parameters(), "lr": 0.5}], lr=0.1
    )
    names = {id(p): name for name, p in before.named_parameters()}
    rebind_optimizer(optimizer, names, dict(after.named_parameters()))
    assert [p for group in optimizer.param_groups for p in group["params"]] == list(after.parameters())
    assert optimizer.param_groups[1]["lr"] == 0.5  # the groups' settings stay


def test_rebind_refuses_an_optimizer_that_took_a_step():
    model = nn.Linear(2, 1)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    with pytest.raises(ValueError, match="already holds state"):
        rebind_optimizer(optimizer, {id(p): n for n, p in model.named_parameters()}, dict(model.named_parameters()))


def test_rebind_refuses_a_parameter_of_another_model():
    model, other = nn.Linear(2, 1), nn.Linear(4, 1)
    optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"shape \(1, 4\) that is not the model's"):
        rebind_optimizer(optimizer, {id(p): n for n, p in model.named_parameters()}, dict(model.named_parameters()))
