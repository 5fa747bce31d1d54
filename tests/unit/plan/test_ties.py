"""Tied parameters (`lightning_dpar.plan.ties`), in process: found once by identity, tied back after a step that
separated them, laid out alike under tensor parallelism or refused, and given to the one FSDP unit (or refused
across DDP units) that encloses every user."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from lightning_dpar.plan.ties import (
    WHOLE,
    check_each_in_one_unit,
    check_tied_layouts,
    describe_tp_placement,
    parameter_owners,
    retie,
    tied_parameters,
)


class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight
        self.blocks[1].bias = self.blocks[0].bias  # a second group, inside one container


def test_tied_parameters_are_every_name_of_one_tensor_in_registration_order():
    model = _TiedLM()
    assert tied_parameters(model) == [("embed.weight", "head.weight"), ("blocks.0.bias", "blocks.1.bias")]
    assert tied_parameters(nn.Linear(2, 2)) == []


def test_retie_makes_every_name_the_first_names_parameter_again():
    model = _TiedLM()
    groups = tied_parameters(model)
    model.head.weight = nn.Parameter(model.embed.weight.detach().clone())  # what `to_empty` / TP do
    assert model.head.weight is not model.embed.weight
    retie(model, groups)
    assert model.head.weight is model.embed.weight and model.blocks[1].bias is model.blocks[0].bias
    assert tied_parameters(model) == groups


@pytest.mark.parametrize(
    ("name", "styles", "want"),
    [
        ("embed.weight", {}, WHOLE),
        ("embed.weight", {"embed": RowwiseParallel()}, "Shard(0)"),
        ("embed.weight", {"embed": ColwiseParallel()}, "Shard(1)"),
        ("head.weight", {"head": ColwiseParallel()}, "Shard(0)"),
        ("head.weight", {"head": RowwiseParallel()}, "Shard(1)"),
        ("head.weight", {"head": SequenceParallel()}, "Replicate()"),
        ("blocks.0.bias", {"blocks.0": ColwiseParallel()}, None),  # a bias: its layout is not modelled
    ],
)
def test_describe_layout_names_the_dim_each_style_splits(name, styles, want):
    assert describe_tp_placement(_TiedLM(), name, styles) == want


def test_tied_embeddings_with_layouts_that_agree_pass_and_others_are_refused_naming_both():
    model = _TiedLM()
    groups = tied_parameters(model)[:1]
    check_tied_layouts(model, groups, {"embed": RowwiseParallel(), "head": ColwiseParallel()})  # both Shard(0)
    check_tied_layouts(model, groups, {})  # both whole
    with pytest.raises(ValueError, match=r"'embed.weight' is Shard\(1\) .*'head.weight' is Shard\(0\)"):
        check_tied_layouts(model, groups, {"embed": ColwiseParallel(), "head": ColwiseParallel()})
    with pytest.raises(ValueError, match=r"'head.weight' is whole on every rank \(not in the tp_plan\)"):
        check_tied_layouts(model, groups, {"embed": RowwiseParallel()})


def test_a_shared_parameter_goes_to_the_innermost_unit_enclosing_all_its_users():
    groups = [("embed.weight", "head.weight"), ("blocks.0.bias", "blocks.1.bias")]
    units = ["blocks.0", "blocks.1", "blocks", "embed", "head", ""]
    assert parameter_owners(groups, units) == {"embed.weight": "", "blocks.0.bias": "blocks"}
    # Both names in one unit already: nothing to move.
    assert parameter_owners([("blocks.0.weight", "blocks.0.weight2")], units) == {}


def test_ddp_refuses_a_parameter_shared_by_two_top_level_units_naming_them():
    groups = [("embed.weight", "head.weight")]
    check_each_in_one_unit(groups, ["model"], "ReplicateStrategy")  # both inside one unit
    with pytest.raises(ValueError, match=r"top-level modules \['embed', 'head'\], which ReplicateStrategy wraps"):
        check_each_in_one_unit(groups, ["embed", "head"], "ReplicateStrategy")


def test_values_stay_shared_through_a_step():
    model = _TiedLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.head(model.embed(torch.tensor([1, 2]))).sum().backward()
    optimizer.step()
    assert torch.equal(model.head.weight, model.embed.weight)
