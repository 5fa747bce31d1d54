"""The pipeline runtime (`lightning_dpar/pipeline/runtime.py`) in-process: one rank of a real gloo group holds both
stages of a 2-stage split (the placement looped and V schedules use), so torch's schedules, the shape probe, the
stage-to-stage hand-over and the forward-only error relay all run here, and the step's loss and gradients are
compared with the unsplit model's. What needs several pipeline ranks (point-to-point sends, `self.log` replayed on
every rank through the Trainer, metrics adopted by other stages) is in `tests/launched/test_pipeline.py`."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.torch_version import TorchVersion
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric

from lightning_dpar.pipeline.config import PipelineConfig
from lightning_dpar.pipeline.log_relay import LogRecorder
from lightning_dpar.pipeline.runtime import PipelineRuntime
from lightning_dpar.pipeline.split import PipelineSplit
from lightning_dpar.pipeline.stage import split_into_stages
from tests.support.models import ParityModule, RegressionData

#: `model.inp` and block 0 on stage 0, block 1 and the head on stage 1, both stages on this rank.
SPLIT = PipelineSplit(stages=(("model.inp", "model.layers.0"), ("model.layers.1", "model.out")), stage_to_rank=(0, 0))
CPU = torch.device("cpu")
#: A training step with both stages on this rank: before its first step torch 2.11's schedule sends a message from
#: each stage to its neighbour, here this very rank, which gloo cannot do (2.13 sends none). Users never place
#: neighbours on one rank except in a V, which `ScheduleSpec.check_runs_on` refuses on 2.11 (tests/unit/pipeline/
#: test_schedule.py); the looped schedules' steps on 2 ranks run on 2.11 in `tests/launched/test_pipeline.py`.
neighbours_on_one_rank = pytest.mark.skipif(
    TorchVersion(torch.__version__) < (2, 13), reason="torch < 2.13 cannot step two neighbour stages on one gloo rank"
)


class _Quiet(ParityModule):
    """ParityModule's steps without `self.log` (replaying logs needs a Trainer's loop: the launched tests)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)  # once: each unit runs once per step
        return {"loss": F.mse_loss(out, y), "out": out}


def _runtime(module, schedule: str = "Interleaved1F1B", microbatches: int = 2) -> PipelineRuntime:
    pipelined = split_into_stages(module, SPLIT, 0, CPU)
    pipelined.install_unit_hooks()
    config = PipelineConfig.of(schedule, microbatches, 2, "auto")
    return PipelineRuntime(pipelined, module, config, dist.group.WORLD, CPU)


def _grads(module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in module.named_parameters()}


@neighbours_on_one_rank
@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"])
def test_a_training_step_gives_the_unsplit_loss_and_gradients(gloo_world, schedule):
    reference = _Quiet()
    module = copy.deepcopy(reference)
    runtime = _runtime(module, schedule, microbatches=4 if schedule == "ZBVZeroBubble" else 2)
    data = RegressionData(n=8)
    loss = runtime.train_step((data.x, data.y), (0,), accumulate_grad_batches=1)
    assert all(p.grad is None for p in module.parameters())  # set aside: Lightning zeroes before backward
    runtime.add_step_gradients()
    want = reference.training_step((data.x, data.y), 0)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), abs=1e-6)
    for name, grad in _grads(reference).items():
        torch.testing.assert_close(_grads(module)[name], grad, rtol=0, atol=1e-6, msg=name)


@neighbours_on_one_rank
def test_accumulated_steps_add_up_to_the_whole_batch(gloo_world):
    reference = _Quiet()
    module = copy.deepcopy(reference)
    runtime = _runtime(module)
    data = RegressionData(n=8)
    for half in (slice(0, 4), slice(4, 8)):
        runtime.train_step((data.x[half], data.y[half]), (0,), accumulate_grad_batches=2)
        runtime.add_step_gradients()
    reference.training_step((data.x, data.y), 0).backward()
    for name, grad in _grads(reference).items():
        torch.testing.assert_close(_grads(module)[name], grad, rtol=0, atol=1e-6, msg=name)


@neighbours_on_one_rank
def test_a_new_batch_shape_gets_its_own_schedule(gloo_world):
    runtime = _runtime(_Quiet())
    data = RegressionData(n=12)
    first = runtime.train_step((data.x[:8], data.y[:8]), (0,), 1)
    second = runtime.train_step((data.x[:4], data.y[:4]), (1,), 1)
    again = runtime.train_step((data.x[:8], data.y[:8]), (2,), 1)
    assert len(runtime._schedules) == 2
    assert first.item() == pytest.approx(again.item())
    assert second.item() != pytest.approx(first.item())


def test_an_evaluation_step_returns_the_last_stages_output(gloo_world):
    reference = _Quiet()
    runtime = _runtime(copy.deepcopy(reference))
    data = RegressionData(n=6)  # evaluation runs the whole batch: no microbatches
    with torch.no_grad():
        output = runtime.eval_step("validation_step", (data.x, data.y), (0,))
        want = reference.validation_step((data.x, data.y), 0)
    torch.testing.assert_close(output["out"], want["out"], rtol=0, atol=1e-6)
    assert output["loss"].item() == pytest.approx(want["loss"].item(), abs=1e-6)


class _SkipsABlock(_Quiet):
    def validation_step(self, batch, batch_idx):
        return self.model.layers[1](F.relu(self.model.inp(batch[0])))  # block 0, stage 0's last unit, never runs


def test_an_error_in_a_forward_only_pass_is_raised_not_waited_for(gloo_world):
    runtime = _runtime(_SkipsABlock())
    data = RegressionData(n=4)
    with pytest.raises(RuntimeError, match=r"stage 0 called 'model\.layers\.1' of the later stage 1"):
        runtime.eval_step("validation_step", (data.x, data.y), (0,))


class _ReturnsOutputs(_Quiet):
    def training_step(self, batch, batch_idx):
        return {"out": self(batch[0])}


def test_a_training_step_must_return_the_loss(gloo_world):
    runtime = _runtime(_ReturnsOutputs())
    data = RegressionData(n=4)
    with pytest.raises(TypeError, match=r"must return the loss.*returned dict"):
        runtime.train_step((data.x, data.y), (0,), 1)


def test_batches_that_do_not_split_into_microbatches_are_refused(gloo_world):
    runtime = _runtime(_Quiet(), microbatches=4)
    data = RegressionData(n=6)
    with pytest.raises(ValueError, match=r"pipeline_microbatches=4.*\[6\] rows"):
        runtime.train_step((data.x, data.y), (0,), 1)
    with pytest.raises(ValueError, match="batches of 6 samples"):
        runtime.check_batches(DataLoader(data, batch_size=6))
    with pytest.raises(ValueError, match="batches of 4 and a last one of 2 samples"):
        runtime.check_batches(DataLoader(data, batch_size=4))
    runtime.check_batches(DataLoader(data, batch_size=4, drop_last=True))  # the short last batch is dropped
    runtime.check_batches(DataLoader(RegressionData(n=8), batch_size=4))


class _Manual(_Quiet):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


def test_manual_optimization_is_refused(gloo_world):
    runtime = _runtime(_Manual())
    data = RegressionData(n=4)
    with pytest.raises(RuntimeError, match="set `automatic_optimization = True`"):
        runtime.train_step((data.x, data.y), (0,), 1)


def test_a_stage_error_in_evaluation_is_raised_with_its_own_traceback(gloo_world):
    class Boom(_Quiet):
        def validation_step(self, batch, batch_idx):
            out = self.model.layers[0](F.relu(self.model.inp(batch[0])))
            if self.model.out.__class__.__name__ != "RemoteUnit":  # only on the stage that holds the head
                raise ValueError("bad labels")
            return self.model.out(self.model.layers[1](out))

    runtime = _runtime(Boom())
    data = RegressionData(n=4)
    with pytest.raises(ValueError, match="bad labels"):  # this rank's own error, with its traceback
        runtime.eval_step("validation_step", (data.x, data.y), (0,))


class _Counting(_Quiet):
    """Updates a metric once per microbatch it trains on (its update count says how many steps reached it)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = MeanMetric()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.seen.update(loss.detach())
        return loss


@neighbours_on_one_rank
def test_the_shape_probe_leaves_metrics_as_they_were(gloo_world):
    module = _Counting()
    runtime = _runtime(module, microbatches=2)
    data = RegressionData(n=8)
    runtime.train_step((data.x, data.y), (0,), 1)  # probe (one microbatch, undone), then the schedule's two
    assert module.seen.update_count == 2
    runtime.train_step((data.x[:4], data.y[:4]), (1,), 1)  # a new shape: probed again, again undone
    assert module.seen.update_count == 4


# ---------------------------------------------------------------------- LogRecorder: what a step's logs become
def test_logged_values_are_combined_over_microbatches_by_their_reduce_fx():
    recorder = LogRecorder()
    for value in (1.0, 3.0):
        recorder.log("loss", torch.tensor(value), prog_bar=True)
        recorder.log("total", value, reduce_fx="sum")
        recorder.log("peak", torch.tensor(value), reduce_fx=torch.max)
    combined = {name: (value.item(), options) for name, value, options in recorder.reduced()}
    assert combined == {
        "loss": (2.0, {"prog_bar": True}),
        "total": (4.0, {"reduce_fx": "sum"}),
        "peak": (3.0, {"reduce_fx": torch.max}),
    }


def test_a_logged_metric_is_passed_on_itself():
    recorder = LogRecorder()
    metric = MeanMetric()
    recorder.log("m", metric)
    recorder.log("m", metric)
    assert recorder.reduced() == [("m", metric, {})]


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (("x", 1.0, True), {}, TypeError, "pass `LightningModule.log` options by keyword"),
        (("x", "text"), {}, TypeError, r"takes a number, a tensor or a torchmetrics `Metric`; got str"),
    ],
)
def test_log_calls_the_pipeline_cannot_replay_are_refused(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        LogRecorder().log(*args, **kwargs)


def test_an_unknown_reduce_fx_names_the_valid_ones():
    recorder = LogRecorder()
    recorder.log("x", 1.0, reduce_fx="median")
    with pytest.raises(ValueError, match=r"reduce_fx='median'.*\['mean', 'avg', 'sum', 'max', 'min'\]"):
        recorder.reduced()
