"""The pipeline split step's runner (`lightning_dpar.pipeline.runner`), both stages on this one gloo rank:
evaluation steps forward-only in the precision plugin's context, a training step's loss, training loaders checked
against the microbatches, and what building it tells the precision plugin and the checkpoint manager. Through real
Trainers on 2 and 4 ranks: `tests/launched/test_pipeline.py`."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.torch_version import TorchVersion
from torch.utils.data import DataLoader

from lightning_dpar.checkpoint.manager import CheckpointManager
from lightning_dpar.optim.precision import DparPrecision
from lightning_dpar.parallel.parallelize import STEPS
from lightning_dpar.pipeline.config import PipelineConfig
from lightning_dpar.pipeline.runner import CheckpointsRead, PipelineSteps, PrecisionRead
from lightning_dpar.pipeline.runtime import PipelineRuntime
from lightning_dpar.pipeline.split import PipelineSplit
from lightning_dpar.pipeline.stage import split_into_stages
from lightning_dpar.pipeline.step import STEP, PlanOptionsRead, pipeline_runner
from lightning_dpar.plan import PlanOptions
from lightning_dpar.steps.contract import Running
from tests.support.models import ParityModule, RegressionData

SPLIT = PipelineSplit(stages=(("model.inp", "model.layers.0"), ("model.layers.1", "model.out")), stage_to_rank=(0, 0))


class Stepped(ParityModule):
    """The loss of a step, and its output in evaluation (bf16 under autocast: the plugin's context applies)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        return self(batch[0])

    test_step = predict_step = validation_step


CONFIG = PipelineConfig.of("Interleaved1F1B", 2, 2, "auto")


def _steps(module, precision: DparPrecision | None = None) -> PipelineSteps:
    pipelined = split_into_stages(module, SPLIT, 0, torch.device("cpu"))
    pipelined.install_unit_hooks()
    runtime = PipelineRuntime(pipelined, module, CONFIG, dist.group.WORLD, torch.device("cpu"))
    return PipelineSteps(runtime, precision or DparPrecision("32-true"))


@pytest.mark.parametrize("step_name", ["validation_step", "test_step", "predict_step"])
def test_an_evaluation_step_runs_in_the_precision_plugins_context(gloo_world, step_name):
    reference = Stepped()
    mixed_precision = DparPrecision("bf16-mixed")
    mixed_precision.autocast_on("cpu")  # as for a wrapper without a mixed-precision policy of its own
    data = RegressionData(n=4)
    with torch.no_grad():
        full = _steps(copy.deepcopy(reference)).eval_step(step_name, ((data.x, data.y), 0))
        mixed = _steps(copy.deepcopy(reference), mixed_precision).eval_step(step_name, ((data.x, data.y), 0))
        want = reference(data.x)
    torch.testing.assert_close(full, want, rtol=0, atol=1e-6)
    assert full.dtype == torch.float32 and mixed.dtype == torch.bfloat16  # autocast on the CPU
    torch.testing.assert_close(mixed.float(), want, rtol=0.05, atol=0.05)


@pytest.mark.skipif(TorchVersion(torch.__version__) < (2, 13), reason="torch < 2.13 cannot step neighbour stages")
def test_a_training_step_returns_the_batchs_loss(gloo_world):
    reference = Stepped()
    steps = _steps(copy.deepcopy(reference))
    data = RegressionData(n=8)
    loss = steps.training_step(((data.x, data.y), 0), accumulate=1)
    assert loss.item() == pytest.approx(reference.training_step((data.x, data.y), 0).item(), abs=1e-6)


def test_a_loader_whose_batches_do_not_split_into_the_microbatches_is_refused(gloo_world):
    steps = _steps(Stepped())
    data = RegressionData(n=10)
    steps.check_batches(DataLoader(data, batch_size=4, drop_last=True))
    with pytest.raises(ValueError, match=r"gives batches of 4 and a last one of 1 samples"):
        steps.check_batches(DataLoader(RegressionData(n=5), batch_size=4))
    with pytest.raises(ValueError, match=r"`pipeline_microbatches=2` equal microbatches, but .* gives batches of 3\b"):
        steps.check_batches(DataLoader(data, batch_size=3, drop_last=True))


def test_the_pipeline_split_is_the_one_step_that_takes_the_training_step_over():
    assert [step.name for step in STEPS if step.runner is not None] == [STEP.name]


def test_the_strategys_plugin_manager_and_options_are_what_the_runner_reads():
    assert isinstance(DparPrecision("32-true"), PrecisionRead)
    assert isinstance(CheckpointManager("sharded", async_save=False), CheckpointsRead)
    assert isinstance(PlanOptions("S", pipeline=CONFIG), PlanOptionsRead)


def test_building_the_runner_sums_norms_over_the_stages_and_tells_the_checkpoints_what_they_hold(gloo_world):
    module = Stepped()
    meshes = SimpleNamespace(pipeline_group=dist.group.WORLD)  # one rank holds both stages: no pipeline mesh dim
    checkpoints = CheckpointManager("sharded", async_save=False)
    precision = DparPrecision("32-true")
    running = Running(module, PlanOptions("S", pipeline=CONFIG), meshes, torch.device("cpu"), precision, checkpoints)
    assert pipeline_runner(None, running) is None  # no pipelining: Lightning's own step hooks run
    pipelined = split_into_stages(module, SPLIT, 0, torch.device("cpu"))
    runner = pipeline_runner(pipelined, running)
    assert isinstance(runner, PipelineSteps) and runner.precision is precision
    assert checkpoints.keys_held_elsewhere == tuple(pipelined.remote_units)
