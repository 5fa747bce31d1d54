"""Which function initialises each meta-device module (`lightning_dpar.plan.initialisers`), and the refusal of a meta
model that nothing would initialise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dpar.plan.initialisers import check_initialisable, initialisers, own_meta_tensors, post_order


class Scale(nn.Module):
    """A parameter and no `reset_parameters`: nothing can initialise it on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(3))
        self.register_buffer("offset", torch.zeros(3))


def test_post_order_visits_children_before_their_parent():
    inner = nn.Sequential(nn.Linear(1, 1), nn.ReLU())
    root = nn.Sequential(inner, nn.Linear(1, 1))
    assert [id(m) for m in post_order(root)] == [id(inner[0]), id(inner[1]), id(inner), id(root[1]), id(root)]


def test_own_meta_tensors_are_the_modules_own_parameters_and_buffers_only():
    with torch.device("meta"):
        root = nn.Sequential(Scale())
    assert own_meta_tensors(root[0]) == ["gain", "offset"]
    assert own_meta_tensors(root) == []  # its child's tensors are not its own
    assert own_meta_tensors(Scale()) == []  # real tensors


def test_a_meta_module_with_reset_parameters_is_initialised_by_it():
    with torch.device("meta"):
        root = nn.Sequential(nn.Linear(3, 2), nn.ReLU())
    found = initialisers(root)
    assert list(found) == [root[0]]  # ReLU and the Sequential hold no tensors of their own
    root[0].to_empty(device="cpu")
    nn.init.zeros_(root[0].weight)
    found[root[0]](root[0])
    assert root[0].weight.abs().sum() > 0  # `reset_parameters` ran
    check_initialisable(root, found)


def test_a_meta_module_nothing_initialises_is_refused_naming_its_class_and_tensors():
    with torch.device("meta"):
        root = nn.Sequential(nn.Linear(3, 3), Scale())
    assert initialisers(root)[root[1]] is None
    with pytest.raises(TypeError, match=r"\['tests\.unit\.plan\.test_initialisers\.Scale \(gain, offset\)'\]"):
        check_initialisable(root)
    check_initialisable(nn.Sequential(Scale()))  # on the CPU nothing needs initialising


def test_inside_a_transformers_model_the_innermost_models_initialiser_serves_each_module():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    found = initialisers(model)
    # The norm (no `reset_parameters` of its own) sits in the base model, the head only in the causal-LM model.
    assert found[model.model.norm] == model.model._init_weights
    assert found[model.lm_head] == model._init_weights
    assert found[model.lm_head] != model.model._init_weights
    assert None not in found.values()
    check_initialisable(model, found)
