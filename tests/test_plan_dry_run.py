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
from lightning_dpar.memory import format_bytes
from lightning_dpar.plan_report import main, plan
from tests.conftest import ROOT
from tests.models import Net

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
            "tp_plan pattern 'model.blocks.*.fc9' matches no module of GPT",
        ),
        (
            ["--trainer.strategy.tp_plan={'model.blocks.*': 'colwise'}"],
            "ColwiseParallel cannot shard 'model.blocks.0' (Block)",
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


def test_format_bytes():
    assert [format_bytes(n) for n in (512, 1536, 3 * 2**30)] == ["512 B", "1.50 KiB", "3.00 GiB"]


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
