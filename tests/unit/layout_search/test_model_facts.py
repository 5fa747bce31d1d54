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
