"""Which modules `compile` compiles (`lightning_dpar.plan.compile`): the FSDP units, else the repeated blocks, else
the LightningModule's children that hold parameters."""

from __future__ import annotations

from torch import nn

from lightning_dpar.plan.compile import compile_units
from tests.support.models import Net


def test_the_sharded_units_come_first():
    assert compile_units(Net(), ["layers.1", "out"]) == ["layers.1", "out"]


def test_without_units_the_repeated_blocks():
    assert compile_units(Net(depth=3), []) == ["layers.0", "layers.1", "layers.2"]
    assert compile_units(Net(), [], blocks=["given"]) == ["given"]


def test_without_blocks_the_children_holding_parameters():
    model = nn.Module()
    model.encoder, model.act, model.head = nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)
    assert compile_units(model, []) == ["encoder", "head"]
    assert compile_units(model, [], blocks=[], top_level_units=["head"]) == ["head"]
