"""What context parallelism refuses before any collective, and the mesh sizes it resolves: each refusal names the
bad value or module and says what to do."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy
from lightning_dpar.context_parallel.checks import (
    block_runs,
    check_batch,
    check_checkpointed_modules,
    check_model,
    check_pipeline_split,
    check_settings,
    sequence_blocks,
)
from lightning_dpar.examples.gpt import GPT
from lightning_dpar.parallel_dims import CONTEXT, DATA_PARALLEL, DATA_SHARD, ParallelDims


@pytest.mark.parametrize(
    ("world", "tp", "cp", "expected"),
    [(4, 1, 4, (1, 4, 4)), (4, 1, 2, (1, 4, 2)), (8, 2, 2, (1, 4, 2))],
)
def test_context_parallel_ranks_are_viewed_out_of_the_shard_dim(world, tp, cp, expected):
    dims = ParallelDims.resolve(world, world, tensor_parallel_size=tp, context_parallel_size=cp)
    assert (dims.replicate, dims.shard, dims.context) == expected
    assert dims.data_parallel == world // (tp * cp)  # ranks seeing different batches
    assert "context" in dims.describe()


def test_hsdp_with_context_parallelism():
    dims = ParallelDims.resolve(8, 8, replicate_size=2, context_parallel_size=2)
    assert (dims.replicate, dims.shard, dims.context, dims.data_parallel) == (2, 4, 2, 4)


def test_the_mesh_has_a_context_dim_and_data_parallel_counts_distinct_batches(fake_world):
    fake_world(8)
    dims = ParallelDims.resolve(8, 8, tensor_parallel_size=2, context_parallel_size=2)
    meshes = dims.build_meshes(torch.device("cpu"))
    mesh, data_parallel, context = meshes.world, meshes.data_parallel, meshes.context
    assert meshes.expert_view is None and context is not None
    assert context.mesh_dim_names == (CONTEXT,) and context.size() == 2
    assert data_parallel.mesh_dim_names == (DATA_PARALLEL,) and data_parallel.size() == 2
    assert DATA_SHARD not in (mesh.mesh_dim_names or ())  # the world mesh keeps its dims: FSDP shards over `shard`
    assert meshes.fsdp.size() == 4  # data_shard x context


def test_sizes_that_do_not_tile_the_world_are_refused():
    with pytest.raises(ValueError, match=r"`context_parallel_size=3` does not divide .* among \[1, 2, 4\]"):
        ParallelDims.resolve(4, 4, context_parallel_size=3)
    with pytest.raises(ValueError, match=r"`data_parallel_size=4` x `tensor_parallel_size=1` x `context_parallel_size"):
        ParallelDims.resolve(4, 4, context_parallel_size=2, data_parallel_size=4)
    with pytest.raises(ValueError, match=r"`expert_parallel_size=2` with `context_parallel_size=2` is not supported"):
        ParallelDims.resolve(8, 8, context_parallel_size=2, expert_parallel_size=2)


def test_the_strategies_resolve_context_parallel_size():
    assert FullyShardStrategy(context_parallel_size=2).resolve_dims(4, 4, 1).context == 2
    assert FullyShardStrategy(context_parallel_size="auto").resolve_dims(4, 4, 1).context == 4
    strategy = FSDPTensorParallelStrategy(tensor_parallel_size=2, context_parallel_size=2)
    assert strategy.resolve_dims(8, 8, 1) == ParallelDims(8, 1, 4, 2, context=2)


def test_dpar_cp_is_registered():
    import lightning as L

    trainer = L.Trainer(strategy="dpar_cp", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, FullyShardStrategy)
    assert trainer.strategy.resolve_dims(4, 4, 1).context == 4


@pytest.mark.parametrize(
    ("setting", "shown"),
    [
        ({"compile_options": {}}, "compile=True"),  # `compile=True`: no options, still compiling
        ({"compile_options": {"mode": "default"}}, "compile={'mode': 'default'}"),
    ],
)
def test_settings_that_do_not_compose_yet_are_refused(setting, shown):
    kwargs = {"compile_options": None, **setting}
    with pytest.raises(ValueError, match=rf"context_parallel_size=2, {re.escape(shown)}\)` is not supported yet"):
        check_settings("FullyShardStrategy", 2, **kwargs)


def test_settings_that_compose_pass():
    check_settings("FullyShardStrategy", 2, compile_options=None)


def test_checkpointing_a_module_enclosing_the_split_blocks_is_refused():
    blocks = ["model.blocks.0", "model.blocks.1"]
    check_checkpointed_modules(blocks, ["model.blocks.0", "model.blocks.1.attn", "lm_head"])  # blocks, inside, outside
    for enclosing in ("model", ""):
        with pytest.raises(ValueError, match=r"encloses the blocks \['model.blocks.0', 'model.blocks.1'\]"):
            check_checkpointed_modules(blocks, [enclosing])


def test_the_runs_of_blocks_are_all_of_them_or_each_stages_own():
    blocks = ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert block_runs(blocks) == [blocks]
    # this rank's stages: the embedding with block 0, blocks 2 and 3 (units inside them), the head alone
    stages = [["embed", "layers.0"], ["layers.2.attn", "layers.2.mlp", "layers.3"], ["head"]]
    assert block_runs(blocks, stages) == [["layers.0"], ["layers.2", "layers.3"]]
    assert block_runs(blocks, [["layers.1"], ["layers.2"]]) == [["layers.1"], ["layers.2"]]  # adjoining: two runs


def test_a_pipeline_split_inside_a_block_is_refused_naming_the_block_and_its_stages():
    blocks = ["layers.0", "layers.1"]
    check_pipeline_split(blocks, [["layers.0.attn", "layers.0.mlp"], ["layers.1"]])
    with pytest.raises(ValueError, match=r"puts parts of block 'layers.1' on stages \[0, 2\]"):
        check_pipeline_split(blocks, [["layers.0", "layers.1.attn"], ["head"], ["layers.1.mlp"]])


def test_the_blocks_are_the_one_outermost_module_list():
    gpt = GPT(n_layer=3, n_embd=16, n_head=2, block_size=8)
    assert [name for name, _ in sequence_blocks(gpt)] == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    moe = GPT(n_layer=2, n_embd=16, n_head=2, block_size=8, n_experts=4)  # experts lists inside the blocks
    assert [name for name, _ in sequence_blocks(moe)] == ["model.blocks.0", "model.blocks.1"]


def test_a_model_without_one_list_of_blocks_is_refused():
    with pytest.raises(ValueError, match=r"Sequential has none\. Hold the layers in one `nn.ModuleList`"):
        check_model(nn.Sequential(nn.Linear(2, 2)))
    two = nn.Module()
    two.encoder, two.decoder = nn.ModuleList([nn.Linear(2, 2)]), nn.ModuleList([nn.Linear(2, 2)])
    with pytest.raises(ValueError, match=r"has \['encoder', 'decoder'\]"):
        check_model(two)


def test_a_transformers_model_without_sdpa_attention_is_refused_by_name():
    transformers = pytest.importorskip("transformers")
    from tests.support.hf_configs import decoder_config

    config = decoder_config()
    config._attn_implementation = "eager"
    with pytest.raises(ValueError, match=r"Module '\(root\)' \(LlamaForCausalLM\) uses attn_implementation='eager'"):
        check_model(transformers.LlamaForCausalLM(config))
    check_model(transformers.LlamaForCausalLM(decoder_config()))  # sdpa: accepted


def test_a_batch_whose_attention_mask_hides_tokens_is_refused():
    ids = torch.zeros(2, 8, dtype=torch.long)
    check_batch({"input_ids": ids, "attention_mask": torch.ones(2, 8)})
    check_batch(ids)
    with pytest.raises(ValueError, match=r"`attention_mask` masks some tokens .* supports causal and full attention"):
        check_batch({"input_ids": ids, "attention_mask": torch.ones(2, 8).tril()})


@pytest.mark.usefixtures("no_pytest_argv")
@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"class_path": "lightning_dpar.FullyShardStrategy", "init_args": {"context_parallel_size": 2}}, 2),
        (
            {
                "class_path": "lightning_dpar.FSDPTensorParallelStrategy",
                "init_args": {"tensor_parallel_size": 2, "context_parallel_size": "auto"},
            },
            "auto",
        ),
        ("dpar_cp", "auto"),
    ],
)
def test_context_parallel_size_from_lightning_cli_yaml(tmp_path, config, expected):
    import yaml
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringModel

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"accelerator": "cpu", "devices": 1, "strategy": config}}))
    cli = LightningCLI(BoringModel, run=False, args=["--config", str(path)], save_config_callback=None)
    assert cli.trainer.strategy._context_parallel_size == expected


def test_the_8b_128k_worked_example_dry_runs_with_context_parallel_8(capsys, monkeypatch):
    """docs/context_parallel.md's worked example: Llama 3 8B's real shapes planned on CP 8 (FSDP over all 8 ranks,
    one distinct batch)."""
    pytest.importorskip("transformers")
    from pathlib import Path

    from lightning_dpar.estimates.cli import main

    root = Path(__file__).resolve().parents[3]
    monkeypatch.syspath_prepend(str(root / "examples" / "finetune"))
    assert main(["--config", str(root / "examples" / "plan" / "llama3_8b_128k.yaml")]) == 0
    out = capsys.readouterr().out
    assert "world=8 = replicate 1 x shard 8 (data_shard 1 x context 8) x tensor_parallel 1" in out
    assert "data_parallel = 1" in out
    assert "Parameters on rank 0 (8,030,261,248 in total)" in out  # Llama 3 8B's published count
