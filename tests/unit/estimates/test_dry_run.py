"""`python -m lightning_dpar plan`: the strategies' own code on a meta-device model and a fake N-rank process group,
in this one process."""

from __future__ import annotations

import resource
import time

import lightning as L
import pytest
import torch
from torch import nn

import lightning_dpar
from lightning_dpar.estimates import main
from lightning_dpar.estimates.dry_run import plan
from lightning_dpar.helpers import format_bytes
from tests.conftest import ROOT
from tests.support.models import Net, SharedWeightsModule

EXAMPLE_2D = str(ROOT / "examples" / "configs" / "2d.yaml")
BIG = str(ROOT / "examples" / "plan" / "gpt_70b.yaml")


pytestmark = pytest.mark.usefixtures("no_pytest_argv")


class TwoLinears(L.LightningModule):
    """Known sizes: weights 16x8 and 8x16, biases 16 and 8 (280 parameters)."""

    def __init__(self, optimizer: str = "adam") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
        self.optimizer = optimizer

    def configure_optimizers(self):
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters())
        if self.optimizer == "adam_amsgrad":
            return {"optimizer": torch.optim.Adam(self.parameters(), amsgrad=True)}
        momentum = 0.9 if self.optimizer == "sgd_momentum" else 0.0
        return [torch.optim.SGD(self.parameters(), lr=0.1, momentum=momentum)], []


def _meta(cls, *args):
    with torch.device("meta"):
        return cls(*args)


@pytest.mark.parametrize(("optimizer", "states"), [("adam", 2), ("adam_amsgrad", 3), ("sgd_momentum", 1), ("sgd", 0)])
def test_memory_formula_on_known_sizes(optimizer, states):
    report = plan(lightning_dpar.FullyShardStrategy(), _meta(TwoLinears, optimizer), world_size=4)
    # Each tensor is split 4 ways on dim 0: 32 + 4 + 32 + 2 = 70 fp32 elements on rank 0.
    assert report.memory.parameters == 70 * 4
    assert report.memory.gradients == 70 * 4
    assert report.memory.optimizer == 70 * 4 * states


def test_bf16_true_halves_every_term():
    strategy = lightning_dpar.FullyShardStrategy()
    strategy.precision_plugin = lightning_dpar.DparPrecision("bf16-true")
    report = plan(strategy, _meta(TwoLinears), world_size=4)
    assert (report.memory.parameters, report.memory.gradients, report.memory.optimizer) == (140, 140, 280)


def test_replicate_keeps_whole_parameters():
    report = plan(lightning_dpar.ReplicateStrategy(), _meta(TwoLinears), world_size=4)
    assert {r.placement for r in report.params} == {"whole on every rank"}
    assert report.memory.parameters == 280 * 4
    assert report.modules == {"net": ["replicate (DDP)"]}


def test_example_2d_plan(capsys):
    assert main(["--config", EXAMPLE_2D]) == 0
    out = capsys.readouterr().out
    assert "world=4 = replicate 1 x shard 2 x tensor_parallel 2" in out
    assert "model.blocks.*.attn.q     TP ColwiseParallel  x2" in out
    assert "model.blocks.*            FSDP unit           x2" in out
    # TP halves the column-wise q weight's rows, FSDP halves them again; LayerNorm is only FSDP-sharded.
    assert "(128, 128)    shard:_S(0, 2), tensor_parallel:S(0)  (32, 128)" in out
    assert "model.blocks.*.ln_1.weight       (128)         shard:S(0)" in out
    assert "optimizer   1.07 MiB   [AdamW: 2 states/param]" in out


def test_offload_plan_says_where_the_memory_lives(capsys):
    assert main(["--config", str(ROOT / "examples" / "configs" / "fsdp_offload.yaml")]) == 0
    assert "note: cpu_offload: parameters, gradients and optimizer state below live in CPU memory" in (
        capsys.readouterr().out
    )


def test_rank_option_shows_that_ranks_coordinate(capsys):
    assert main(["--config", EXAMPLE_2D, "--rank", "3"]) == 0
    assert "rank 3 is at replicate=0, shard=1, tensor_parallel=1" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--world-size", "6", "--trainer.strategy.tensor_parallel_size=4"], "does not divide the world size 6"),
        (
            ["--trainer.strategy.tp_plan={'model.blocks.*.fc9': 'colwise'}"],
            "tp_plan pattern 'model.blocks.*.fc9' matches no module of lightning_dpar.examples.gpt.GPT",
        ),
        (
            ["--trainer.strategy.tp_plan={'model.blocks.*': 'colwise'}"],
            "ColwiseParallel cannot shard 'model.blocks.0' (lightning_dpar.examples.gpt.Block)",
        ),
    ],
)
def test_bad_plans_fail_with_the_training_errors(capsys, args, message):
    assert main(["--config", EXAMPLE_2D, *args]) == 1
    assert message in capsys.readouterr().err


def test_65b_plan_on_64_ranks_runs_in_seconds_without_memory(capsys):
    peak_rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    start = time.perf_counter()
    assert main(["--config", BIG]) == 0
    elapsed = time.perf_counter() - start
    # The model is never allocated: 65B fp32 parameters would be 242 GiB, even one rank's shard 3.8 GiB.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak_rss_before < 2**30
    out = capsys.readouterr().out
    assert "64,984,989,696 in total" in out
    assert "world=64 = replicate 1 x shard 8 x tensor_parallel 8" in out
    assert "model.blocks.*            activation checkpointing, FSDP unit  x80" in out
    # fp32 master weights of 65B parameters over 64 ranks, a bit more since embeddings are FSDP-sharded only.
    assert "parameters  4.01 GiB" in out and "optimizer   8.02 GiB" in out
    assert elapsed < 60


def test_plan_refuses_a_materialised_model():
    with pytest.raises(ValueError, match="meta device"):
        plan(lightning_dpar.FullyShardStrategy(), TwoLinears(), world_size=2)


class HandParallelised(L.LightningModule):
    """Written for Lightning's ModelParallelStrategy: applies TP itself in `configure_model`."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Net()

    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {"layers.0.fc1": ColwiseParallel(), "layers.0.fc2": RowwiseParallel()}
        parallelize_module(self.model, self.device_mesh["tensor_parallel"], plan)


def test_plan_adopts_a_model_parallel_strategy_configure_model():
    strategy = lightning_dpar.FSDPTensorParallelStrategy(tensor_parallel_size=2)
    report = plan(strategy, _meta(HandParallelised), world_size=4)
    assert "configure_model applied its own parallelism" in report.notes[0]
    rows = {r.name: r for r in report.params}
    # (12, 15) colwise over TP 2 -> 6 rows, then FSDP over the 2 data-parallel ranks -> 3 rows.
    assert rows["model.layers.0.fc1.weight"].local_shape == (3, 15)
    assert "tensor_parallel:S(0)" in rows["model.layers.0.fc1.weight"].placement
    assert rows["model.layers.1.fc1.weight"].placement == "shard:S(0)"  # untouched by TP, sharded by FSDP
    assert "FSDP unit" in report.modules["model"]


# ---------------------------------------------------------------- pipeline parallelism


def _gpt(n_layer: int):
    from lightning_dpar.examples import GPT

    return _meta(GPT, 256, 128, n_layer)  # vocab 256, context 128, width 128, 4 heads


#: The example GPT's parameter counts at width 128: embeddings 256x128 and 128x128, one block (2 LayerNorms, q/k/v/
#: proj 128x128, mlp 128x512 and 512x128), final LayerNorm and head 128x256.
EMBEDDINGS, BLOCK, LN_F_AND_HEAD = 256 * 128 + 128 * 128, 4 * 128 + 4 * 128 * 128 + 2 * 128 * 512, 2 * 128 + 128 * 256


def test_pipeline_stages_even_split_with_tensor_parallel():
    strategy = lightning_dpar.FSDPTensorParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2)
    report = plan(strategy, _gpt(4), world_size=4)
    pipeline = report.pipeline
    assert (pipeline.schedule, pipeline.microbatches, pipeline.stages_per_rank) == ("1F1B", 2, 1)
    where = [(row.stage, row.pipeline_rank, list(row.ranks)) for row in pipeline.stages]
    assert where == [(0, 0, [0, 1]), (1, 1, [2, 3])]
    assert pipeline.stages[0].units == ("model.tok_emb", "model.pos_emb", "model.blocks.0", "model.blocks.1")
    assert pipeline.stages[1].units == ("model.blocks.2", "model.blocks.3", "model.ln_f", "model.head")
    assert [row.num_params for row in pipeline.stages] == [EMBEDDINGS + 2 * BLOCK, 2 * BLOCK + LN_F_AND_HEAD]
    # Per rank, TP 2 halves the blocks' matrices; embeddings, LayerNorms and the head stay whole (FSDP over 1 rank).
    matrices = 4 * 128 * 128 + 2 * 128 * 512
    per_rank = [EMBEDDINGS + 2 * (BLOCK - matrices // 2), 2 * (BLOCK - matrices // 2) + LN_F_AND_HEAD]
    assert [row.memory.parameters for row in pipeline.stages] == [4 * n for n in per_rank]  # fp32
    assert [row.memory.optimizer for row in pipeline.stages] == [8 * n for n in per_rank]  # AdamW: 2 states
    assert pipeline.bubble == pytest.approx(1 / 3)  # (p-1)/(m+p-1) with p = m = 2
    # The rank shown in detail holds stage 0 only: the whole model's count is given beside its own.
    assert report.total_params == EMBEDDINGS + 2 * BLOCK
    assert report.model_params == EMBEDDINGS + 4 * BLOCK + LN_F_AND_HEAD
    assert report.memory == pipeline.stages[0].memory


def test_pipeline_uneven_split_puts_the_extra_blocks_in_the_middle_and_loops_stages():
    strategy = lightning_dpar.FullyShardStrategy(
        pipeline_parallel_size=2, pipeline_schedule="Interleaved1F1B", pipeline_stages_per_rank=2
    )
    report = plan(strategy, _gpt(6), world_size=4)  # 4 stages for 6 blocks: 1, 2, 2, 1
    stages = report.pipeline.stages
    assert [row.units for row in stages] == [
        ("model.tok_emb", "model.pos_emb", "model.blocks.0"),
        ("model.blocks.1", "model.blocks.2"),
        ("model.blocks.3", "model.blocks.4"),
        ("model.blocks.5", "model.ln_f", "model.head"),
    ]
    assert [row.pipeline_rank for row in stages] == [0, 1, 0, 1]
    assert [row.num_params for row in stages] == [EMBEDDINGS + BLOCK, 2 * BLOCK, 2 * BLOCK, BLOCK + LN_F_AND_HEAD]
    # FSDP over the 2 ranks of each stage halves every parameter (all first dims are even); fp32, AdamW 2 states.
    for row in stages:
        assert (row.memory.parameters, row.memory.gradients, row.memory.optimizer) == (
            2 * row.num_params,
            2 * row.num_params,
            4 * row.num_params,
        )
    assert report.pipeline.microbatches == 4  # by default one per stage
    assert report.pipeline.bubble == pytest.approx(1 / (2 * 4 + 1))  # (p-1)/(v*m+p-1), p = v = 2, m = 4
    out = report.render()
    assert "model.tok_emb, model.pos_emb, model.blocks.0" in out and "model.blocks.1-2" in out
    total_rank_1 = 8 * (2 * BLOCK + BLOCK + LN_F_AND_HEAD)
    assert f"pipeline rank 1 holds stages 1, 3: {format_bytes(total_rank_1)} per rank" in out
    # Showing a rank of pipeline rank 1 plans that rank directly: the same memory as its two stage rows.
    shown = plan(strategy, _gpt(6), world_size=4, rank=3)
    assert shown.memory.total == total_rank_1 == stages[1].memory.total + stages[3].memory.total


def test_pipeline_explicit_split_points():
    strategy = lightning_dpar.FullyShardStrategy(pipeline_parallel_size=2, pipeline_split=["model.blocks.1"])
    report = plan(strategy, _gpt(4), world_size=2)
    assert [row.units[-1] for row in report.pipeline.stages] == ["model.blocks.0", "model.head"]
    assert "split at ['model.blocks.1']" in report.render()


def test_pipeline_dry_run_through_the_cli(capsys, tmp_path):
    assert main(["--trainer.strategy=dpar_3d"]) == 0
    out = capsys.readouterr().out
    assert "world=4 = pipeline 2 x replicate 1 x shard 1 x tensor_parallel 2" in out
    assert "Pipeline: schedule 1F1B, 2 microbatches per batch (default: one per stage), 1 stage per" in out
    assert "0      0              0-1    model.tok_emb, model.pos_emb, model.blocks.0" in out
    config = tmp_path / "pp.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_dpar.FullyShardStrategy\n    init_args:\n"
        "      pipeline_parallel_size: 2\n      pipeline_schedule: GPipe\n      pipeline_microbatches: 4\n"
    )
    assert main(["--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "world=4 = pipeline 2 x replicate 1 x shard 2 x tensor_parallel 1" in out
    assert "Pipeline: schedule GPipe, 4 microbatches per batch, 1 stage per pipeline rank" in out
    with pytest.raises(ValueError, match=r"`pipeline_schedule='Nope'` is not a pipeline schedule"):
        main(["--config", str(config), "--trainer.strategy.init_args.pipeline_schedule=Nope"])


LLAMA_405B = str(ROOT / "examples" / "plan" / "llama3_405b.yaml")
GPT_405B = str(ROOT / "examples" / "plan" / "gpt_405b.yaml")
LLAMA_70B = str(ROOT / "examples" / "plan" / "llama3_70b.yaml")


def test_llama3_70b_worked_example_on_64_ranks_is_torchtitans_layout(capsys, monkeypatch):
    """The dense worked example of docs/auto-layout.md: Llama 3 70B's real shapes on TP 8 x FSDP 8."""
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "finetune"))
    assert main(["--config", LLAMA_70B]) == 0
    out = capsys.readouterr().out
    assert "world=64 = replicate 1 x shard 8 x tensor_parallel 8" in out
    assert "Parameters on rank 0 (70,553,706,496 in total)" in out  # Llama 3 70B's published count
    assert "model.model.layers.*.mlp.gate_proj     TP ColwiseParallel" in out


@pytest.mark.slow  # several seconds (a search in a child process, or a large model traced): full suite only
def test_llama3_405b_on_1024_ranks_pipeline_16_tp_8_fsdp_8(monkeypatch):
    """The worked example of docs/pipeline.md: Llama 3 405B's real shapes, built on meta from its config.json."""
    pytest.importorskip("transformers")
    from lightning_dpar.cli import cli_main

    monkeypatch.syspath_prepend(str(ROOT / "examples" / "finetune"))  # the config's `llama_module.LlamaFineTune`
    peak_rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    cli = cli_main(["--config", LLAMA_405B], run=False, model_on_meta=True)
    batch = cli.datamodule.batch_shape  # (64, 8193): as docs/pipeline.md runs it, with the activation estimate
    source = "from --batch-size and --seq-len"  # what the CLI says of the docs' command line
    report = plan(cli.trainer.strategy, cli.model, world_size=1024, num_nodes=128, batch=batch, batch_source=source)
    # Planning takes seconds; tracing a training step of 126 layers twice (with and without activation
    # checkpointing) on fake tensors takes most of this bound (about 45 s of CPU time).
    assert time.perf_counter() - start < 240
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak_rss_before < 2**30
    assert report.model_params == 405_853_388_800  # Llama 3 405B's published count
    assert report.dims.describe() == "world=1024 = pipeline 16 x replicate 1 x shard 8 x tensor_parallel 8"
    stages = report.pipeline.stages
    assert len(stages) == 16 and [list(row.ranks)[::63] for row in stages[:2]] == [[0, 63], [64, 127]]
    # 126 layers over 16 stages: 8 each in the middle, 7 on the first and last (which hold embeddings and head).
    layers = [sum(".layers." in unit for unit in row.units) for row in stages]
    assert layers == [7] + [8] * 14 + [7]
    assert stages[0].units[0] == "model.model.embed_tokens"
    assert stages[-1].units[-2:] == ("model.model.norm", "model.lm_head")
    assert sum(row.num_params for row in stages) == report.model_params
    # Per rank, every matrix is split 64 ways (TP 8 x FSDP 8) and each RMSNorm weight 8 ways (FSDP only); fp32
    # master weights under bf16-mixed, AdamW's 2 states.
    hidden, ffn, kv = 16384, 53248, 8 * 128
    layer = (2 * hidden * hidden + 2 * kv * hidden + 3 * ffn * hidden) // 64 + 2 * hidden // 8
    embedding = 128256 * hidden // 64
    assert stages[1].memory.parameters == 4 * 8 * layer
    assert stages[0].memory.parameters == 4 * (7 * layer + embedding)
    assert stages[0].memory.optimizer == 2 * stages[0].memory.parameters
    assert report.memory == stages[0].memory
    # Activation checkpointing keeps each layer's input, a microbatch of 8193 tokens x 16384 x bf16 = 256 MiB,
    # whole on every TP rank: stage 0's 7 layers and the output it sends on. 1F1B keeps 16 microbatches in flight
    # on the first stage, 1 on the last.
    activations = report.activations.rank(0)
    assert activations.in_flight == (16,) and report.activations.rank(15).in_flight == (1,)
    layer_input = 8193 * 16384 * 2
    assert 8 * layer_input <= activations.per_microbatch(True).retained < 8.5 * layer_input
    # docs/pipeline.md quotes this output (rows it leaves out are marked `...`): every line it shows is real.
    rendered = report.render().splitlines()
    quoted = (ROOT / "docs" / "pipeline.md").read_text().split("```text\n")[1].split("```")[0].splitlines()
    assert len(quoted) > 30
    assert [line for line in quoted if line.strip() not in ("", "...") and line not in rendered] == []


@pytest.mark.slow  # several seconds (a search in a child process, or a large model traced): full suite only
def test_gpt_405b_config_shows_heavier_first_and_last_stages(capsys):
    """The example GPT's `tp_plan` leaves embeddings and head to FSDP alone: the dry run shows what that costs."""
    assert main(["--config", GPT_405B]) == 0
    out = capsys.readouterr().out
    assert "(24,784,601,088 of the model's 410,219,610,112)" in out
    # A middle stage: 8 blocks of 12 x 16384^2 matrices split 64 ways and 4 LayerNorm vectors split 8 ways, fp32.
    middle = 8 * (12 * 16384 * 16384 // 64 + 4 * 16384 // 8) * 4
    assert f"model.blocks.7-14                               25,770,328,064  {format_bytes(middle)}" in out
    assert "0      0              0-63      model.tok_emb, model.pos_emb, model.blocks.0-6" in out
    assert "2.35 GiB     2.35 GiB    4.71 GiB        9.41 GiB" in out  # stage 0: 1.5x a middle stage


def test_pipeline_v_schedule_puts_the_first_and_last_stage_on_one_rank():
    strategy = lightning_dpar.FullyShardStrategy(
        pipeline_parallel_size=2, pipeline_schedule="ZBVZeroBubble", pipeline_stages_per_rank=2
    )
    report = plan(strategy, _gpt(4), world_size=2)
    assert [row.pipeline_rank for row in report.pipeline.stages] == [0, 1, 1, 0]
    assert report.pipeline.bubble is None  # no closed form printed for zero-bubble schedules
    out = report.render()
    assert "pipeline rank 0 holds stages 0, 3" in out and "bubble" not in out
    # Rank 0 holds the embeddings (stage 0) and the head (stage 3): whole, FSDP over 1 rank, fp32, AdamW.
    both = EMBEDDINGS + BLOCK + BLOCK + LN_F_AND_HEAD
    assert report.total_params == both and report.memory.total == 16 * both
    # Zero-bubble schedules keep the stages' units gathered from forward to backward: all of rank 0's parameters.
    assert f"stages all-gathered, {format_bytes(4 * both)}, stay in memory during a step" in out


def test_parameters_shared_by_several_units_go_to_the_unit_enclosing_their_users():
    """A block reused by every layer goes to the body (not to each layer's unit), a parameter tied across two
    top-level modules to the LightningModule's own unit; each stays one parameter."""
    with torch.device("meta"):
        module = SharedWeightsModule()
    report = plan(lightning_dpar.FullyShardStrategy(), module, world_size=2)
    text = report.render()
    assert "  first.weight = last.weight: FSDP unit (the LightningModule)" in text
    assert (
        "  body.layers.0.ffn.fc1.weight = body.layers.1.ffn.fc1.weight = body.layers.2.ffn.fc1.weight: FSDP unit body"
        in text
    )
    assert report.modules["(the LightningModule)"] == ["FSDP unit (its own parameters; step methods gather them)"]
    assert module.body.layers[0].ffn.fc1.weight is module.body.layers[2].ffn.fc1.weight
    assert module.first.weight is module.last.weight
    assert report.total_params == sum(p.numel() for p in SharedWeightsModule().parameters())


def test_ddp_refuses_a_parameter_shared_by_two_top_level_modules():
    with torch.device("meta"):
        module = SharedWeightsModule()
    with pytest.raises(ValueError, match=r"\['first.weight', 'last.weight'\] are one tensor used by the top-level"):
        plan(lightning_dpar.ReplicateStrategy(), module, world_size=2)
    with torch.device("meta"):
        module = SharedWeightsModule(tie_top_level=False)  # the block shared inside `body` is one DDP unit's
    plan(lightning_dpar.ReplicateStrategy(), module, world_size=2)


# ---------------------------------------------------------------------------------------------------- activations


def test_the_dry_run_estimates_loss_parallels_sharded_logits():
    """The `plan` dry run under TP 2 with the example GPT's head gathered, then with `loss_parallel=True`: the
    activations it reports fall by at least half the logits' log-probabilities the loss keeps, and it says which
    layer's logits stay sharded."""
    from lightning_dpar.examples.gpt import TP_PLAN

    tp_plan = {**TP_PLAN, "model.head": "colwise_gather_output"}
    batch = (4, 129)  # 128 positions with their next tokens, the example GPT's `_loss`
    reports = [
        plan(
            lightning_dpar.FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=tp_plan, loss_parallel=enabled),
            _gpt(2),
            world_size=2,
            batch=batch,
        )
        for enabled in (False, True)
    ]
    kept = [report.activations.rank(0).per_microbatch(False).retained for report in reports]
    logits = 4 * 128 * 256 * 4  # fp32
    assert kept[0] - kept[1] == logits // 2
    assert "loss parallel: the logits of model.head kept sharded over the vocabulary" in reports[1].render()
    assert "loss parallel" not in reports[0].render()
