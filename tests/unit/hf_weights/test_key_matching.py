"""Matching checkpoint keys to a model's (`lightning_dpar.hf_weights.key_matching`): pure, on keys and shapes only;
tied names count as one, and every gap is named."""

from __future__ import annotations

from torch import nn

from lightning_dpar.hf_weights.key_matching import KeyMapping, describe, map_keys, tied_groups

MODEL = {"model.embed.weight": (10, 4), "model.layer.weight": (4, 4), "model.head.weight": (10, 4)}
TIED = [["model.embed.weight", "model.head.weight"]]


def test_matching_keys_under_the_prefix_fill_the_model():
    checkpoint = {"embed.weight": (10, 4), "layer.weight": (4, 4), "head.weight": (10, 4)}
    mapping = map_keys(MODEL, checkpoint, "model.")
    assert mapping.to_model == {key: f"model.{key}" for key in checkpoint}
    assert (mapping.missing, mapping.unexpected, mapping.mismatched) == ([], [], [])
    assert mapping.problems(strict=True) == [] and describe(mapping) == ""


def test_one_name_of_a_tied_group_sets_them_all_and_is_read_once():
    only_head = map_keys(MODEL, {"layer.weight": (4, 4), "head.weight": (10, 4)}, "model.", TIED)
    assert only_head.missing == []
    both = map_keys(MODEL, {"embed.weight": (10, 4), "head.weight": (10, 4), "layer.weight": (4, 4)}, "model.", TIED)
    assert both.to_model == {"embed.weight": "model.embed.weight", "layer.weight": "model.layer.weight"}
    untied = map_keys(MODEL, {"layer.weight": (4, 4), "head.weight": (10, 4)}, "model.")
    assert untied.missing == ["model.embed.weight"]


def test_gaps_are_named_and_only_shapes_fail_a_non_strict_load():
    checkpoint = {"layer.weight": (4, 5), "extra.bias": (3,), "head.weight": (10, 4)}
    mapping = map_keys(MODEL, checkpoint, "model.")
    assert mapping.mismatched == ["layer.weight: checkpoint (4, 5), model (4, 4)"]
    assert mapping.unexpected == ["extra.bias"]
    assert mapping.missing == ["model.embed.weight", "model.layer.weight"]
    assert mapping.problems(strict=False) == ["shapes differ: layer.weight: checkpoint (4, 5), model (4, 4)"]
    assert mapping.problems(strict=True)[1:] == [
        "keys of the model not in the checkpoint: 'model.embed.weight', 'model.layer.weight'",
        "keys of the checkpoint not in the model: 'extra.bias'",
    ]
    assert describe(mapping) == (
        "kept their own initialisation (not in the checkpoint): 'model.embed.weight', 'model.layer.weight'; "
        "ignored (not in the model): 'extra.bias'"
    )


def test_incomplete_fused_parameters_are_problems_strict_or_not_and_long_lists_are_counted():
    mapping = KeyMapping(incomplete=["experts 0..3 of 'gate_up_proj': expert 2 is missing"])
    assert mapping.problems(strict=False) == mapping.incomplete
    many = KeyMapping(missing=[f"k{i}" for i in range(23)])
    assert many.problems(strict=True)[0].endswith("'k19' and 3 more")


def test_tied_groups_are_the_names_sharing_a_parameter():
    model = nn.Module()
    model.embed, model.head, model.other = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False), nn.Linear(4, 4)
    model.head.weight = model.embed.weight
    assert [sorted(group) for group in tied_groups(model)] == [["embed.weight", "head.weight"]]
