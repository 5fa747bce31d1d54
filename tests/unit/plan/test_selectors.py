"""Choosing modules by class or name glob (`lightning_dpar.plan.selectors`), and the blocks each option defaults to."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_dpar.plan.selectors import (
    fqn_matches,
    resolve_activation_checkpointing,
    resolve_blocks,
    select_modules,
)
from tests.support.models import Block, Net


def test_a_glob_matches_segment_by_segment_and_needs_as_many_segments():
    assert fqn_matches("layers.*.fc[12]", "layers.0.fc2")
    assert not fqn_matches("layers.*", "layers.0.fc2")  # '*' does not cross a dot
    assert not fqn_matches("layers.*.fc1", "layers.0")
    assert fqn_matches("Layers.0", "Layers.0") and not fqn_matches("layers.0", "Layers.0")  # case counts


def test_selectors_give_module_order_without_repeats_whatever_their_order():
    net = Net(depth=3)
    chosen = select_modules(net, ["layers.2", Block, "torch.nn.modules.linear.Linear"], "shard_modules")
    linears = [f"layers.{i}.{fc}" for i in range(3) for fc in ("fc1", "fc2")]
    expected = ["inp", *[x for i in range(3) for x in (f"layers.{i}", *linears[2 * i : 2 * i + 2])], "out"]
    assert chosen == expected


def test_a_selector_that_matches_nothing_names_itself_the_option_and_the_classes():
    with pytest.raises(ValueError, match=r"`ignored_modules` entry 'Conv2d' matches no module.*'Block'.*'inp'"):
        select_modules(Net(), ["Conv2d"], "ignored_modules")


def test_blocks_default_to_the_repeated_ones_or_those_found_already():
    net = Net(depth=2)
    assert resolve_blocks(net, None, "shard_modules") == ["layers.0", "layers.1"]
    assert resolve_blocks(net, None, "shard_modules", blocks=["found"]) == ["found"]
    assert resolve_blocks(net, ["out"], "shard_modules", blocks=["found"]) == ["out"]


def test_activation_checkpointing_true_means_the_sharded_units_else_the_blocks():
    net = Net(depth=2)
    assert resolve_activation_checkpointing(net, False, ["inp"]) == []
    assert resolve_activation_checkpointing(net, True, ["inp", "out"]) == ["inp", "out"]
    assert resolve_activation_checkpointing(net, True, []) == ["layers.0", "layers.1"]
    assert resolve_activation_checkpointing(net, True, [], blocks=["b"]) == ["b"]
    assert resolve_activation_checkpointing(net, ["layers.*.fc2"], ["inp"]) == ["layers.0.fc2", "layers.1.fc2"]
    with pytest.raises(ValueError, match="`activation_checkpointing` entry 'nope'"):
        resolve_activation_checkpointing(net, ["nope"], [])


def test_a_model_without_a_module_list_has_no_default_blocks():
    assert resolve_blocks(nn.Sequential(nn.Linear(2, 2)), None, "shard_modules") == []
