"""Optimizer state re-keyed between parameter names (DCP's form) and positions (`torch.optim`'s own form), in one
process: `lightning_dpar.checkpoint.full.names_to_positions` / `positions_to_names`.

torch gives both forms of the same state: `get_optimizer_state_dict` (names) and `Optimizer.state_dict()`
(positions). The model has two param groups listing parameters out of model order, and a frozen parameter without
state, so numbering by model order or by stateful parameters only would give other keys.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from lightning_dpar.checkpoint.full import names_to_positions, positions_to_names


@pytest.fixture
def trained():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)  # in a group, but never stepped: no state
    groups = [{"params": [model[1].weight, model[0].weight]}, {"params": [model[0].bias, model[1].bias], "lr": 0.1}]
    optimizer = torch.optim.Adam(groups, lr=0.01)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(5, 3)).square().sum().backward()
        optimizer.step()
    return model, optimizer


def _assert_same_state(got: dict, want: dict) -> None:
    assert got["param_groups"] == want["param_groups"]
    assert list(got["state"]) == list(want["state"])
    for key, state in want["state"].items():
        assert set(got["state"][key]) == set(state)
        for name, value in state.items():
            torch.testing.assert_close(got["state"][key][name], value, rtol=0, atol=0)


def test_names_to_positions_gives_torchs_own_optimizer_state_dict(trained):
    model, optimizer = trained
    by_name = get_optimizer_state_dict(model, optimizer)
    assert list(by_name["state"]) == ["1.weight", "0.weight", "1.bias"]
    _assert_same_state(names_to_positions(by_name), optimizer.state_dict())


def test_positions_to_names_is_the_inverse_for_this_optimizer(trained):
    model, optimizer = trained
    _assert_same_state(
        positions_to_names(optimizer.state_dict(), model, optimizer), get_optimizer_state_dict(model, optimizer)
    )


def test_a_plain_optimizer_loads_the_position_keyed_state(trained):
    model, optimizer = trained
    position_keyed = names_to_positions(get_optimizer_state_dict(model, optimizer))
    fresh = torch.optim.Adam([{"params": g["params"], "lr": g["lr"]} for g in optimizer.param_groups], lr=0.01)
    fresh.load_state_dict(position_keyed)
    _assert_same_state(fresh.state_dict(), optimizer.state_dict())


def test_empty_and_already_named_states_pass_through(trained):
    model, optimizer = trained
    assert names_to_positions({}) == {}  # what ranks other than 0 receive from a full gather
    by_name = get_optimizer_state_dict(model, optimizer)
    assert positions_to_names(by_name, model, optimizer) is by_name
    no_state = {"state": {}, "param_groups": optimizer.state_dict()["param_groups"]}
    assert positions_to_names(no_state, model, optimizer) is no_state
