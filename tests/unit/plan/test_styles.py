"""The registry of tensor-parallel style names (`lightning_dpar.plan.styles`): what each name builds, per module, and
the parsing of a user's `tp_plan` against it."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from lightning_dpar.plan.styles import (
    AUTO,
    HF_STYLES,
    STYLE_NAMES,
    STYLES,
    UNSUPPORTED_HF_STYLES,
    NamedStyle,
    parse_style,
    parse_tp_plan,
    rowwise_style,
)


def test_row_wise_keeps_an_embeddings_token_ids_whole_and_splits_a_linears_input():
    embedding, linear = rowwise_style(nn.Embedding(8, 4)), rowwise_style(nn.Linear(4, 4))
    assert type(embedding) is RowwiseParallel and type(linear) is RowwiseParallel
    assert embedding.input_layouts == (Replicate(),)
    assert linear.input_layouts == (Shard(-1),)


@pytest.mark.parametrize(
    ("name", "style_type", "input_layout", "output_layout"),
    [
        ("colwise", ColwiseParallel, Replicate(), Shard(-1)),
        ("colwise_gather_output", ColwiseParallel, Replicate(), Replicate()),
        ("colwise_rep", ColwiseParallel, Replicate(), Replicate()),
        ("rowwise_split_input", RowwiseParallel, Replicate(), Replicate()),
        ("embedding_colwise", ColwiseParallel, Replicate(), Replicate()),
    ],
)
def test_each_transformers_name_builds_the_torch_style_with_its_layouts(name, style_type, input_layout, output_layout):
    style = STYLES[name](nn.Linear(4, 4))
    assert type(style) is style_type
    assert (style.input_layouts, style.output_layouts) == ((input_layout,), (output_layout,))


def test_replicate_keeps_the_module_whole_and_per_head_norms_sum_their_gradients():
    assert STYLES["replicate"](nn.Linear(2, 2)) is None
    norm = STYLES["replicated_with_grad_allreduce"](nn.LayerNorm(4))
    assert type(norm) is SequenceParallel
    assert norm.sequence_sharding == (Shard(-2),) and norm.use_local_output is True


def test_the_name_sets():
    assert STYLE_NAMES <= set(STYLES)
    assert "sequence_parallel" not in HF_STYLES and "colwise" in HF_STYLES
    assert not set(UNSUPPORTED_HF_STYLES) & set(STYLES)  # a name is either built or refused, never both


def test_parse_style_takes_names_case_insensitively_and_style_objects_as_given():
    named = parse_style("fc1", "ColWise")
    assert named == NamedStyle("colwise", STYLES["colwise"]) and repr(named) == "'colwise'"
    given = RowwiseParallel()
    assert parse_style("fc2", given) is given
    assert parse_style("fc2", named) is named
    with pytest.raises(ValueError, match=r"tp_plan\['fc1'\] = 'column' is not a tensor-parallel style.*'colwise'"):
        parse_style("fc1", "column")
    with pytest.raises(ValueError, match=r"= 3 is not"):
        parse_style("fc1", 3)


def test_parse_tp_plan_refuses_what_is_not_a_plan_naming_it():
    assert parse_tp_plan(None) is None
    assert parse_tp_plan({"a.*": "rowwise"}) == {"a.*": NamedStyle("rowwise", rowwise_style)}
    with pytest.raises(ValueError, match="resolved against the model"):
        parse_tp_plan(AUTO)
    with pytest.raises(TypeError, match="got list: \\['colwise'\\]"):
        parse_tp_plan(["colwise"])
    with pytest.raises(ValueError, match="tp_plan key '' must be a non-empty module-name pattern"):
        parse_tp_plan({"": "colwise"})
