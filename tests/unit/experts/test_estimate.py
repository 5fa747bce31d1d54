"""The `plan` dry run of expert-parallel layouts: who holds which experts, the expert and other parameter memory, and
the worked example of docs/moe.md (Qwen3-235B-A22B on 256 ranks), in this one process."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_dpar import FullyShardStrategy
from lightning_dpar.estimates import main, plan
from tests.conftest import ROOT
from tests.support import moe

EXAMPLE_MOE = str(ROOT / "examples" / "configs" / "moe.yaml")
QWEN3_235B = str(ROOT / "examples" / "plan" / "qwen3_235b_a22b.yaml")
DEEPSEEK_V3 = str(ROOT / "examples" / "plan" / "deepseek_v3.yaml")

pytestmark = pytest.mark.usefixtures("no_pytest_argv")


def test_example_moe_plan_shows_the_experts_each_rank_holds(capsys):
    assert main(["--config", EXAMPLE_MOE, "--rank", "3"]) == 0
    out = capsys.readouterr().out
    assert "world=4 = replicate 1 x shard 4 (expert_shard 2 x expert 2) x tensor_parallel 1" in out
    assert "model.blocks.*.mlp.experts  expert parallel 2, FSDP unit  x2" in out
    assert "8 experts; rank 3 (expert=1) holds experts 4-7 (by expert rank: 0: 0-3, 1: 4-7)" in out
    # fc and proj: 8 x 512 x 128 each, 2 layers, fp32: 4 MiB per layer; EP 2 x FSDP 2 leaves a quarter.
    assert "parameters on rank 3: experts 2.00 MiB, other 211.27 KiB" in out
    assert "(8, 512, 128)  expert_shard:_S(0, 2), expert:S(0)  (2, 512, 128)" in out
    # FSDP gathers the 4 experts this rank's expert coordinate holds (2 MiB a layer), not all 8.
    assert "the largest FSDP unit all-gathered for compute: 2.00 MiB (model.blocks.0.mlp.experts)" in out


@pytest.mark.slow  # a docs worked example, a 256-rank dry run (3-5 s): the full suite keeps it true
def test_worked_example_qwen3_235b_on_256_ranks(capsys, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "finetune"))
    assert main(["--config", QWEN3_235B]) == 0
    out = capsys.readouterr().out
    assert "world=256 = replicate 1 x shard 256 (expert_shard 32 x expert 8) x tensor_parallel 1" in out
    assert "128 experts; rank 0 (expert=0) holds experts 0-15" in out
    assert "parameters on rank 0: experts 3.30 GiB, other 59.96 MiB" in out
    assert "Parameters on rank 0 (235,093,634,560 in total)" in out
    assert "total       13.45 GiB" in out


def test_experts_after_dense_layers_are_described_from_a_layer_that_has_them():
    """DeepSeek-V3's first layers are dense (`first_k_dense_replace`): the report reads the experts' count off the
    first layer that holds experts, not off layer 0 (which has no `mlp.experts`)."""
    pytest.importorskip("transformers")
    from transformers import DeepseekV3ForCausalLM

    class DenseFirst(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = DeepseekV3ForCausalLM(moe.deepseek_v3_config())

    with torch.device("meta"):
        module = DenseFirst()
    out = plan(FullyShardStrategy(expert_parallel_size=2), module, world_size=4).render()
    assert "model.layers.*.mlp.experts x2: 4 experts; rank 0 (expert=0) holds experts 0-1" in out


def test_the_example_module_traces_deepseek_v3_under_activation_checkpointing(tmp_path, monkeypatch):
    """`examples/finetune/llama_module.py` steps with `use_cache=False`: with the key/value cache, the checkpointed
    blocks' recomputation appends to the cache the forward filled, and DeepSeek-V3's recomputed keys come out twice
    as long (torch's CheckpointError in backward, and no activation estimate here)."""
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "finetune"))
    from llama_module import LlamaFineTune

    moe.deepseek_v3_config(num_hidden_layers=2).save_pretrained(tmp_path)  # a dense layer, then one of experts
    module = LlamaFineTune(str(tmp_path))
    strategy = FullyShardStrategy(expert_parallel_size=2, activation_checkpointing=True)
    report = plan(strategy, module, world_size=4, batch=(2, 17), batch_source="test")
    estimate = report.activations
    assert estimate is not None, report.activation_note
    # Traced under the plan's checkpointing: every decoder layer checkpointed, and keeping less than without it.
    assert estimate.checkpointing and estimate.checkpointed
    assert all(".layers." in name for name in estimate.checkpointed)
    assert 0 < estimate.peak(checkpointing=True) < estimate.peak(checkpointing=False)


@pytest.mark.slow  # a docs worked example, a 256-rank dry run (3-5 s): the full suite keeps it true
def test_worked_example_deepseek_v3_on_256_ranks(capsys, monkeypatch):
    """The MoE worked example of docs/auto-layout.md: transformers' DeepSeek-V3 at its real size, EP 8 x FSDP."""
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "finetune"))
    assert main(["--config", DEEPSEEK_V3]) == 0
    out = capsys.readouterr().out
    assert "world=256 = replicate 1 x shard 256 (expert_shard 32 x expert 8) x tensor_parallel 1" in out
    assert "model.model.layers.*.mlp.experts x58: 256 experts; rank 0 (expert=0) holds experts 0-31" in out
    assert "Parameters on rank 0 (671,026,404,352 in total)" in out  # without the multi-token-prediction module


def test_describe_experts_on_one_expert_rank(gloo_world):
    """`describe_experts` by itself: on a one-rank expert mesh the rank holds every expert of each experts module
    (grouped over the repeated layers), and the parameter bytes split into the experts' and the rest."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_dpar.examples.gpt import GPT
    from lightning_dpar.experts.estimate import describe_experts
    from lightning_dpar.parallel_dims import ParallelDims
    from lightning_dpar.plan import ModulePlan

    module = GPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8, n_experts=4)
    experts = ["model.blocks.0.mlp.experts", "model.blocks.1.mlp.experts"]
    expert_bytes = sum(p.numel() * 4 for name, p in module.named_parameters() if name.startswith(tuple(experts)))
    assert expert_bytes > 0
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("expert",))
    dims = ParallelDims(1, 1, 1, 1)
    assert describe_experts(module, ModulePlan({}, [], []), dims, mesh, rank=0) == []  # no experts in the plan
    lines = describe_experts(module, ModulePlan({}, [], [], experts=experts), dims, mesh, rank=0)
    assert lines[0] == (
        "  model.blocks.*.mlp.experts x2: 4 experts; rank 0 (expert=0) holds experts 0-3 (by expert rank: 0: 0-3),"
        " FSDP-sharded over expert_shard 1"
    )
    assert lines[1].startswith(f"  parameters on rank 0: experts {expert_bytes / 1024:.2f} KiB, other ")
