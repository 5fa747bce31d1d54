"""Which modules expert parallelism splits, and what it refuses, in-process on meta models (`lightning_dpar.plan.
experts`, the expert dim of `lightning_dpar.parallel_dims`, and `tp_plan="auto"` on a transformers MoE model). Training
on 2
and 4 gloo ranks is in `tests/launched/test_moe.py`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_dpar
from lightning_dpar.examples.gpt import GPT
from lightning_dpar.examples.moe import Experts
from lightning_dpar.experts.plan import check_experts_contract, find_experts, plan_experts
from lightning_dpar.parallel.parallelize import plan_modules
from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.plan import transformers_tp_plan
from lightning_dpar.plan.planner import PlanOptions
from lightning_dpar.plan.selectors import pattern_reaches
from lightning_dpar.plan.transformers import transformers_experts


def example_moe(n_experts: int = 4) -> GPT:
    with torch.device("meta"):
        return GPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8, n_experts=n_experts)


def test_experts_are_found_by_the_contract():
    assert find_experts(example_moe()) == ["model.blocks.0.mlp.experts", "model.blocks.1.mlp.experts"]
    assert find_experts(example_moe(n_experts=0)) == []  # dense blocks: no MoE layer


def test_each_contract_breach_is_named():
    class NoCount(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4, 2, 2))

        def forward(self, x, idx, w):
            return x

    class Unstacked(NoCount):
        num_experts = 4

        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(3, 2))

    class OneInput(NoCount):
        num_experts = 4

        def forward(self, x):
            return x

    class Nested(NoCount):
        num_experts = 4

        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(2, 2)

    cases = [
        (NoCount(), "`num_experts` is None"),
        (Unstacked(), "parameters {'bias': (3, 2)} do not have the 4 experts along dim 0"),
        (OneInput(), "does not take `(hidden_states, top_k_index, top_k_weights)`"),
        (Nested(), "its children ['inner'] hold parameters"),
    ]
    for module, breach in cases:
        with pytest.raises(ValueError, match="cannot be split between expert-parallel ranks") as caught:
            check_experts_contract(module, "layers.0.experts")
        assert breach in str(caught.value)
    check_experts_contract(Experts(4, 4), "ok")


def test_an_expert_parallel_size_must_divide_the_experts():
    with pytest.raises(ValueError, match=r"does not divide the 6 experts of 'model.blocks.0.mlp.experts'") as caught:
        plan_experts(example_moe(n_experts=6), expert_parallel_size=4, shard_size=8, selectors=None)
    assert "Valid sizes on this mesh: [1, 2]." in str(caught.value)


def test_expert_parallelism_on_a_dense_model_is_refused():
    with pytest.raises(ValueError, match=r"`expert_parallel_size=2` needs Mixture-of-Experts layers, but .*GPT"):
        plan_experts(example_moe(n_experts=0), expert_parallel_size=2, shard_size=2, selectors=None)
    assert plan_experts(example_moe(n_experts=0), expert_parallel_size=1, shard_size=2, selectors=None) == []


def test_named_expert_modules_are_checked_against_the_contract():
    model = example_moe()
    assert plan_experts(model, 2, 2, ["model.blocks.0.mlp.experts"]) == ["model.blocks.0.mlp.experts"]
    with pytest.raises(ValueError, match=r"'model.blocks.0.mlp.router' \(.*Router\) cannot be split"):
        plan_experts(model, 2, 2, ["model.blocks.0.mlp.router"])


@pytest.mark.parametrize(
    ("kwargs", "expert", "described"),
    [
        (dict(world_size=4, devices_per_node=4, expert_parallel_size=2), 2, "shard 4 (expert_shard 2 x expert 2)"),
        (dict(world_size=8, devices_per_node=4, expert_parallel_size="auto"), 4, "shard 8 (expert_shard 2 x expert 4)"),
        (dict(world_size=8, devices_per_node=8, tensor_parallel_size=2, expert_parallel_size="auto"), 4, None),
        (dict(world_size=8, devices_per_node=4, replicate_size=2, expert_parallel_size=4), 4, None),
    ],
)
def test_the_expert_dim_is_borrowed_from_the_shard_dim(kwargs, expert, described):
    dims = ParallelDims.resolve(**kwargs)
    assert dims.expert == expert
    assert dims.expert_shard * dims.expert == dims.shard
    if described:
        assert described in dims.describe()


def test_an_expert_parallel_size_must_divide_the_shard_ranks():
    with pytest.raises(ValueError, match=r"`expert_parallel_size=3` does not divide .* 4: .* among \[1, 2, 4\]"):
        ParallelDims.resolve(world_size=4, devices_per_node=4, expert_parallel_size=3)
    with pytest.raises(ValueError, match=r"shard the model, 2 \(data-parallel size 4 / replicate_size 2\)"):
        ParallelDims.resolve(world_size=4, devices_per_node=4, replicate_size=2, expert_parallel_size=4)


def test_replicate_refuses_expert_parallelism():
    with pytest.raises(ValueError, match=r"`ReplicateStrategy` does not split experts \(`expert_parallel_size=2`\)"):
        lightning_dpar.ReplicateStrategy(expert_parallel_size=2)


def test_dpar_ep_splits_the_experts_over_one_nodes_shard_ranks():
    import lightning as L

    strategy = L.Trainer(strategy="dpar_ep", accelerator="cpu", devices=1, logger=False).strategy
    assert isinstance(strategy, lightning_dpar.FullyShardStrategy)
    assert (
        strategy.resolve_dims(8, 4, 2).describe()
        == "world=8 = replicate 1 x shard 8 (expert_shard 2 x expert 4) x tensor_parallel 1"
    )


def test_a_tensor_parallel_plan_reaching_into_split_experts_is_refused():
    model = example_moe()
    dims = ParallelDims.resolve(world_size=4, devices_per_node=4, tensor_parallel_size=2, expert_parallel_size=2)
    options = PlanOptions("FSDPTensorParallelStrategy", tp_plan={"model.blocks.*.mlp.experts": "colwise"})
    with pytest.raises(ValueError, match=r"inside the experts modules that `expert_parallel_size=2` splits"):
        plan_modules(model, dims, options)


def test_pattern_reaches_names_inside_a_module():
    experts = ["net.model.layers.0.mlp.experts", "net.model.layers.1.mlp.experts"]
    assert pattern_reaches("net.model.layers.*.mlp.experts.gate_up_proj", experts)
    assert pattern_reaches("net.model.layers.*.mlp.experts", experts)
    assert not pattern_reaches("net.model.layers.*.mlp.gate", experts)
    assert not pattern_reaches("net.model.layers.*.mlp", experts)


class TestTransformersMoE:
    @pytest.fixture
    def qwen3_moe(self):
        pytest.importorskip("transformers")
        from tests.workers.moe import HFMoEModule

        with torch.device("meta"):
            return HFMoEModule()

    def test_auto_plan_leaves_the_experts_to_expert_parallelism(self, qwen3_moe):
        experts = find_experts(qwen3_moe)
        assert experts == ["net.model.layers.0.mlp.experts", "net.model.layers.1.mlp.experts"]
        assert transformers_experts(qwen3_moe) == ["net.model.layers.*.mlp.experts"]  # its base_model_ep_plan
        plan = transformers_tp_plan(qwen3_moe, leave_out=experts)
        assert not any(".mlp." in key for key in plan)  # the experts' entries, and the dense MLP's (no such layer)
        assert plan["net.model.layers.*.self_attn.q_proj"] == "colwise"

    def test_auto_plan_without_expert_parallelism_says_what_to_set(self, qwen3_moe):
        dims = ParallelDims.resolve(world_size=2, devices_per_node=2, tensor_parallel_size=2)
        options = PlanOptions("FSDPTensorParallelStrategy", tp_plan="auto")
        with pytest.raises(ValueError, match=r"'packed_colwise'.* set `expert_parallel_size`"):
            plan_modules(qwen3_moe, dims, options)

    def test_plan_with_expert_parallelism_and_tensor_parallelism(self, qwen3_moe):
        dims = ParallelDims.resolve(world_size=4, devices_per_node=4, tensor_parallel_size=2, expert_parallel_size=2)
        plan = plan_modules(qwen3_moe, dims, PlanOptions("FSDPTensorParallelStrategy", tp_plan="auto", shards=True))
        assert plan.experts == ["net.model.layers.0.mlp.experts", "net.model.layers.1.mlp.experts"]
        assert "net.model.layers.0.self_attn.q_proj" in plan.tensor_parallel
        assert not any(".mlp." in fqn for fqn in plan.tensor_parallel)
