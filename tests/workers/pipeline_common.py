"""The models, callbacks and helpers of the pipeline cases (`tests/workers/pipeline.py`): the strategy under test,
single-process references, whole-model and whole-optimizer gathers over the stages, and the LightningModules each
case trains."""

from __future__ import annotations

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy
from tests.support.models import (
    TP_PLAN,
    Block,
    Net,
    ParityModule,
    RegressionData,
    loader,
    make_optimizer,
)
from tests.workers.checkpoint_common import flat_tensors
from tests.workers.common import BATCH, trainer_for, world_size

PIPELINE = 2


def gather_objects(value):
    values = [None] * world_size()
    dist.all_gather_object(values, value)
    return values


def whole_model(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """The full parameters of every stage, on every rank (each stage gathers its shards, then stages exchange)."""
    state = get_model_state_dict(trainer.lightning_module, options=StateDictOptions(full_state_dict=True))
    merged: dict[str, torch.Tensor] = {}
    for part in gather_objects({k: v.detach().cpu() for k, v in state.items()}):
        merged.update(part)
    return merged


def whole_optimizer(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    options = StateDictOptions(full_state_dict=True)
    state = get_optimizer_state_dict(trainer.lightning_module, trainer.optimizers[0], options=options)
    merged: dict[str, torch.Tensor] = {}
    for part in gather_objects({k: v.detach().cpu() for k, v in flat_tensors("state", state["state"]).items()}):
        merged.update(part)
    return merged


def pipeline_strategy(schedule="1F1B", stages_per_rank=1, tensor_parallel=1, **kwargs):
    options = dict(
        pipeline_parallel_size=PIPELINE, pipeline_schedule=schedule, pipeline_stages_per_rank=stages_per_rank
    )
    if tensor_parallel > 1:
        return FSDPTensorParallelStrategy(tensor_parallel_size=tensor_parallel, tp_plan=TP_PLAN, **options, **kwargs)
    return FullyShardStrategy(**options, **kwargs)


def data_parallel(tensor_parallel: int = 1) -> int:
    return world_size() // PIPELINE // tensor_parallel


class LossRecorder(L.Callback):
    """The `train_loss` every rank's Trainer holds after each step (what its loggers and progress bar get)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def reference_losses(optimizer: str, batches, depth: int, clip_norm=None, accumulate=1) -> list[float]:
    """The loss of each batch Lightning's `training_step` sees (each accumulated micro-batch), before its step, in
    single-process training."""
    torch.manual_seed(0)
    model = Net(depth=depth)
    opt = make_optimizer(optimizer, model.parameters())
    losses = []
    for x, y in batches:
        opt.zero_grad()
        with torch.no_grad():
            losses.extend(F.mse_loss(model(xm), ym).item() for xm, ym in zip(x.chunk(accumulate), y.chunk(accumulate)))
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        opt.step()
    return losses


class HeadFirstNet(nn.Module):
    """LitGPT's layout: the head registered before the trunk that holds the embedding and the blocks."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(15, 5)
        layers = nn.ModuleList(Block(15, 12) for _ in range(depth))
        self.trunk = nn.ModuleDict({"inp": nn.Linear(5, 15), "layers": layers})

    def forward(self, x):
        x = F.relu(self.trunk["inp"](x))
        for layer in self.trunk["layers"]:
            x = layer(x)
        return self.head(x)


class HeadFirstModule(ParityModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = HeadFirstNet()


class SeenModule(ParityModule):
    """Records the sample indices of each batch (once per batch, in a hook: `training_step` runs per microbatch)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seen: list[list[int]] = []

    def on_train_batch_start(self, batch, batch_idx):
        self.seen.append(batch[2].tolist())

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("test_loss", F.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        x, _, index = batch
        return {"index": index, "prediction": self(x)}


class CountingLinear(nn.Linear):
    """Counts the elements its initialiser fills on this rank: what materialisation allocated."""

    filled = 0

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if not self.weight.is_meta:  # building on the meta device runs it too, allocating nothing
            CountingLinear.filled += self.weight.numel() + self.bias.numel()


class MetaInitModule(ParityModule):
    """Builds the model on the meta device in `configure_model`, as a model too large for one rank would."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.save_hyperparameters({"optimizer": "sgd"})
        self.model: nn.Module | None = None

    def configure_model(self):
        if self.model is not None:
            return
        saved, nn.Linear = nn.Linear, CountingLinear  # `Net` builds its layers with `nn.Linear`
        try:
            with torch.device("meta"):
                self.model = Net(depth=4)
        finally:
            nn.Linear = saved


class MetricModule(SeenModule):
    """Logs torchmetrics objects: the validation loss as a `MeanSquaredError`, and the number of samples seen as a
    `SumMetric` (reduced over data-parallel peers only, it counts each sample once)."""

    def __init__(self) -> None:
        super().__init__()
        from torchmetrics import MeanSquaredError, SumMetric

        self.val_mse = MeanSquaredError()
        self.val_samples = SumMetric()
        self.train_mse = MeanSquaredError()

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        prediction = self(x)
        self.train_mse(prediction, y)
        self.log("train_mse", self.train_mse, on_step=True, on_epoch=False)
        return F.mse_loss(prediction, y)

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.val_mse(self(x), y)
        self.val_samples(torch.ones(len(x)))
        self.log("val_mse", self.val_mse, on_epoch=True, sync_dist=True)
        self.log("val_samples", self.val_samples, on_epoch=True, reduce_fx="sum")


class ApplicationRecorder(L.Callback):
    """Which blocks each rank compiled and checkpoints (read once the model is parallelised)."""

    def on_train_start(self, trainer, pl_module) -> None:
        from torch.distributed._composable.contract import _get_registry

        modules = list(pl_module.named_modules())
        self.compiled = [n for n, m in modules if getattr(m, "_compiled_call_impl", None) is not None]
        self.checkpointed = [n for n, m in modules if "checkpoint" in (_get_registry(m) or {})]


class SkippingModule(ParityModule):
    """Returns None from `training_step` to skip a batch, which a pipeline cannot do (every stage ran its part)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        F.mse_loss(self(x), y)
        return None


class ReusedLayerModule(ParityModule):
    """Calls its first block twice (weight sharing): a stage cut between units cannot run that."""

    def forward(self, x):
        model = self.model
        x = F.relu(model.inp(x))
        x = model.layers[0](model.layers[0](x))
        return model.out(model.layers[1](x))


class SummedLogModule(ParityModule):
    """Logs the samples of each microbatch with `reduce_fx="sum"`: the step's value must count the whole batch."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.log("samples", float(len(x)), reduce_fx="sum")
        return F.mse_loss(self(x), y)


class CheckpointModule(SeenModule):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def expect_error(make_strategy, module=None, batch_size=BATCH) -> list[str | None]:
    """The error each rank got fitting `module` (default `ParityModule`) under the strategy, in rank order (None
    where it trained); the process group is started afterwards if the error came before it, to gather them."""
    message = None
    try:
        trainer = trainer_for(make_strategy())
        trainer.fit(module or ParityModule(), loader(RegressionData(), batch_size))
    except Exception as err:
        message = f"{type(err).__name__}: {err}"
    if not dist.is_initialized():  # the error came before the strategy set up the processes, as it should
        dist.init_process_group("gloo")
    return gather_objects(message)
