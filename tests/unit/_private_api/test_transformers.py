"""transformers' private names (`lightning_dpar._private_api.transformers`) on a real tiny Llama: a transformers
upgrade that moves one fails here first."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dpar._private_api.torch_core import FakeTensorMode
from lightning_dpar._private_api.transformers import (
    transformers_attention_implementation,
    transformers_module_initialiser,
    transformers_supports_sdpa,
    transformers_tp_plan_attribute,
    unpacked_positions_on_fake_tensors,
)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama():
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    return transformers.LlamaForCausalLM(config)


def test_the_per_module_initialiser_initialises_one_module(llama):
    init = transformers_module_initialiser(llama)
    norm = llama.model.norm
    with torch.no_grad():
        norm.weight.fill_(5.0)
    init(norm)
    assert torch.equal(norm.weight, torch.ones(16))  # transformers initialises RMSNorm weights to one


def test_the_merged_plan_holds_the_heads_and_the_base_models(llama):
    plan = transformers_tp_plan_attribute(llama)
    assert plan["lm_head"] == "colwise_gather_output"  # the head's own plan
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"  # the base model's, under its prefix
    assert transformers_tp_plan_attribute(nn.Linear(2, 2)) is None


def test_the_attention_implementation_and_whether_the_family_has_sdpa(llama):
    assert transformers_attention_implementation(llama) == "sdpa"
    assert transformers_attention_implementation(nn.Linear(2, 2)) is None
    assert transformers_supports_sdpa(llama)

    class NoSdpa(nn.Module):
        _supports_sdpa = False

    assert not transformers_supports_sdpa(NoSdpa()) and transformers_supports_sdpa(nn.Linear(1, 1))


def test_fake_position_ids_count_as_unpacked_inside_the_context_only():
    from transformers import masking_utils

    packed = torch.tensor([[0, 1, 2, 0, 1]])
    original = masking_utils.find_packed_sequence_indices
    with unpacked_positions_on_fake_tensors():
        assert masking_utils.find_packed_sequence_indices(packed).tolist() == [[0, 0, 0, 1, 1]]  # real: as before
        with FakeTensorMode() as mode:
            fake = mode.from_tensor(packed)
        assert masking_utils.find_packed_sequence_indices(fake) is None
    assert masking_utils.find_packed_sequence_indices is original
