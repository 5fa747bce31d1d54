"""The facts the layout cost model reads off a model (`lightning_dpar.layout_search.model_facts`)."""

from __future__ import annotations

import pytest
import torch

from lightning_dpar.layout_search.model_facts import facts_of
from tests.support import moe


def test_moe_facts_count_the_experts_modules_not_the_routers():
    """DeepSeek-V3's router carries `num_experts` and a `[num_experts, hidden]` weight of its own; only the experts
    modules (the contract of `lightning_dpar.experts.plan`) are experts: 2 MoE layers, not 4, and the routers'
    weights are dense parameters every token passes through."""
    pytest.importorskip("transformers")
    from transformers import DeepseekV3ForCausalLM

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(moe.deepseek_v3_config())
    facts = facts_of(model, seq_len=16, batch_size=2)
    layers = model.model.layers
    experts = sum(p.numel() for layer in layers[1:] for p in layer.mlp.experts.parameters())
    assert (facts.experts, facts.experts_per_token, facts.moe_layers) == (4, 2, 2)
    assert facts.expert_params == experts
    assert facts.active_params == facts.params - experts + experts * 2 // 4


def test_float8_converts_the_linear_layers_of_multiples_of_16_but_the_output_layer():
    """The float8 step's default rule: an `nn.Linear` whose in and out features are multiples of 16 (what
    `torch._scaled_mm` takes), not the output layer, not one a `float8_skip` pattern names."""
    from lightning_dpar.examples import GPT
    from lightning_dpar.layout_search.model_facts import float8_linears

    with torch.device("meta"):
        gpt = GPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)
    converted = float8_linears(gpt)
    per_block = ["attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "mlp.proj"]
    assert converted == [f"model.blocks.{i}.{name}" for i in range(2) for name in per_block]
    assert "model.head" not in converted  # the output layer, though 64 x 256
    facts = facts_of(gpt, seq_len=32, batch_size=2)
    assert facts.float8_params == sum(gpt.get_submodule(fqn).weight.numel() for fqn in converted)
    assert facts.float8_params == 2 * (4 * 64 * 64 + 2 * 64 * 256)
    # `float8_skip` replaces the default, as the strategy's argument does: the output layer is converted too
    skipped = facts_of(gpt, seq_len=32, batch_size=2, float8_skip=["*.attn.*"])
    assert skipped.float8_params == 2 * 2 * 64 * 256 + 64 * 256
    with torch.device("meta"):
        sizes = [(64, 32), (32, 40), (40, 48), (48, 16)]
        odd = torch.nn.Sequential(*(torch.nn.Linear(i, o) for i, o in sizes))
    assert float8_linears(odd) == ["0"]  # 40 is no multiple of 16; the last layer is the output layer
