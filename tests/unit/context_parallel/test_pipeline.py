"""Context parallelism across pipeline stages, without processes: the blocks each stage runs (`block_runs`), the
split refused when it cuts a block, the plan every pipeline rank gets, the mesh of pipeline x context parallel
ranks, and the hooks of one stage (one rank simulated): the part received, the part sent on, the gather at the end."""

from __future__ import annotations

import pytest
import torch

from lightning_dpar.context_parallel import ContextParallel, HeadTailLayout, block_runs, check_pipeline_split
from lightning_dpar.examples.gpt import GPT
from lightning_dpar.parallel.parallelize import plan_modules
from lightning_dpar.parallel_dims import CONTEXT, PIPELINE, ParallelDims
from lightning_dpar.pipeline.config import PipelineConfig
from lightning_dpar.plan.planner import PlanOptions
from tests.unit.context_parallel.test_runtime import Model, Rotary

BLOCKS = ["m.blocks.0", "m.blocks.1", "m.blocks.2", "m.blocks.3"]


def test_each_stage_runs_its_own_blocks_and_adjoining_stages_stay_apart():
    assert block_runs(BLOCKS) == [BLOCKS]
    stages = [["m.emb", "m.blocks.0"], ["m.blocks.1", "m.blocks.2"], ["m.blocks.3", "m.head"]]
    assert block_runs(BLOCKS, [stages[0], stages[2]]) == [["m.blocks.0"], ["m.blocks.3"]]
    assert block_runs(BLOCKS, stages[1:]) == [["m.blocks.1", "m.blocks.2"], ["m.blocks.3"]]  # two forwards
    assert block_runs(BLOCKS, [["m.emb"]]) == []  # a stage of the embedding alone splits nothing
    assert block_runs(BLOCKS, [["m.blocks.1.attn", "m.blocks.1.mlp"]]) == [["m.blocks.1"]]  # units inside a block


def test_a_split_cutting_a_block_is_refused():
    check_pipeline_split(BLOCKS, [["m.blocks.0", "m.blocks.1.attn", "m.blocks.1.mlp"], ["m.blocks.2", "m.blocks.3"]])
    with pytest.raises(ValueError, match=r"puts parts of block 'm.blocks.1' on stages \[0, 1\]: .* Split between"):
        check_pipeline_split(BLOCKS, [["m.blocks.0", "m.blocks.1.attn"], ["m.blocks.1.mlp", "m.blocks.2"]])


def _options(split="auto", **kwargs) -> PlanOptions:
    return PlanOptions("FullyShardStrategy", pipeline=PipelineConfig.of("GPipe", None, 1, split), shards=True, **kwargs)


def test_every_pipeline_rank_plans_every_block_and_a_split_inside_one_is_refused():
    with torch.device("meta"):
        model = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    dims = ParallelDims.resolve(4, 4, pipeline_parallel_size=2, context_parallel_size=2)
    for rank in range(4):
        plan = plan_modules(model, dims, _options(), rank=rank)
        assert plan.context_parallel == ["model.blocks.0", "model.blocks.1"]
        assert plan.pipeline_rank == rank // 2
    inside = _options(["model.blocks.0.mlp"], shard_modules=["CausalSelfAttention", "MLP"])
    with pytest.raises(ValueError, match=r"puts parts of block 'model.blocks.0' on stages \[0, 1\]"):
        plan_modules(model, dims, inside)


def test_the_mesh_has_pipeline_and_context_dims(fake_world):
    fake_world(8)
    dims = ParallelDims.resolve(8, 8, pipeline_parallel_size=2, context_parallel_size=2)
    assert (dims.pipeline, dims.shard, dims.context, dims.data_parallel) == (2, 4, 2, 2)
    meshes = dims.build_meshes(torch.device("cpu"))
    assert meshes.world.mesh_dim_names[0] == PIPELINE and meshes.world.size(0) == 2
    assert meshes.context is not None and meshes.context.mesh_dim_names == (CONTEXT,) and meshes.context.size() == 2
    assert meshes.data_parallel.size() == 2 and meshes.fsdp.size() == 4  # data_shard x context, within a stage


def _stage(model: Model, runs: list[list[str]]) -> ContextParallel:
    """One rank of 2 simulated, holding the blocks of `runs` (its stages')."""
    order = ["layers.0", "layers.1"]
    held = [(name, model.get_submodule(name)) for run in runs for name in run]
    return ContextParallel(held, HeadTailLayout(2, 0), None, runs, order)


def test_a_later_stage_takes_the_part_it_receives_and_cuts_the_whole_sequence_arguments():
    model = Model()
    runtime = _stage(model, [["layers.1"]])
    part = torch.randn(3, 8, 8)  # this rank's 8 of 16 tokens, from the previous stage
    rotary = Rotary(torch.ones(1, 16, 4), torch.zeros(1, 16, 4))  # computed whole on every stage
    with runtime.active():
        out = model.layers[1](part, rotary, torch.arange(16))
    assert model.layers[1].seen == [(8, 8, 8, 8)]
    assert out.shape == (3, 16, 8) and not runtime.attention.active  # the model's last block: gathered whole
    assert runtime.attention.calls == 1


def test_an_earlier_stage_sends_its_part_on_and_closes_the_split():
    model = Model()
    runtime = _stage(model, [["layers.0"]])
    rotary = Rotary(torch.ones(1, 16, 4), torch.zeros(1, 16, 4))
    with runtime.active():
        out = model.layers[0](torch.randn(3, 16, 8), rotary, torch.arange(16))
        assert out.shape == (3, 8, 8) and not runtime.attention.active  # the part, for the next stage
        again = model.layers[0](torch.randn(3, 16, 8), rotary, torch.arange(16))  # the next microbatch splits anew
    assert again.shape == (3, 8, 8) and model.layers[0].seen == [(8, 8, 8, 8)] * 2


def test_the_activation_estimate_splits_each_stage_s_blocks_and_sends_the_part():
    """PP 2 x CP 2 traced as one context-parallel rank (the estimate the layout search reads): the stages together
    retain what the unpipelined CP 2 estimate does for the same microbatch (validated against measurement in
    tests/launched/test_context_parallel.py), and the boundary carries half of what it carries without CP."""
    from lightning_dpar.estimates.activations import estimate_activations

    with torch.device("meta"):
        model = GPT(vocab_size=256, block_size=512, n_layer=4, n_head=4, n_embd=64)
    config = PipelineConfig.of("1F1B", None, 1, "auto")
    stages = {}
    for cp in (1, 2):
        dims = ParallelDims.resolve(4, 4, pipeline_parallel_size=2, context_parallel_size=cp)
        plans = [plan_modules(model, dims, _options(), rank=rank) for rank in range(4)]
        estimate = estimate_activations(model, plans, dims, (4, 513), pipeline=config)
        stages[cp] = [rank.stages[0] for rank in estimate.ranks]
    assert stages[2][0].sent == stages[2][1].received == stages[1][0].sent // 2 > 0
    dims = ParallelDims.resolve(2, 2, context_parallel_size=2)
    whole = estimate_activations(model, plan_modules(model, dims, _options()), dims, (2, 513)).rank(0).stages[0]
    for checkpointing in (False, True):
        retained = [stage.footprint(checkpointing).retained - stage.received for stage in stages[2]]
        assert sum(retained) == whole.footprint(checkpointing).retained
        assert all(r < stage.footprint(checkpointing).retained for r, stage in zip(retained, stages[1]))


def test_the_per_rank_loss_with_pipelining_is_refused_when_the_plan_is_made():
    with torch.device("meta"):
        model = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    dims = ParallelDims.resolve(4, 4, pipeline_parallel_size=2, context_parallel_size=2)
    with pytest.raises(ValueError, match=r"context_parallel_loss='per_rank'\)` is not supported yet: .* Use"):
        plan_modules(model, dims, _options(context_parallel_loss="per_rank"))
