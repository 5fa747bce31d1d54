"""Cases for `tests/launched/test_features.py`: behaviour beyond parity, through real Trainers: data-parallel reductions
and metrics, ignored modules, plan sources (LightningModule attribute, a `ModelParallelStrategy`-style
`configure_model`), meta-device init, fit followed by validate/test/predict in one process, and gradient
accumulation without communication."""

from __future__ import annotations

from collections.abc import Iterator

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torchmetrics.aggregation import SumMetric

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, ReplicateStrategy
from tests.support.models import TP_PLAN, Net, ParityModule, RegressionData, global_batches, loader, reference_train
from tests.workers.cases import Case, one_case
from tests.workers.common import BATCH, STEPS, full_params, trainer_for, world_size
from tests.workers.parity import counting_allreduce_hook


class SyncModule(ParityModule):
    """Logs its data-parallel rank and feeds a torchmetrics metric, to see which ranks each reduction spans."""

    def __init__(self) -> None:
        super().__init__()
        self.dp_rank_metric = SumMetric()

    def training_step(self, batch, batch_idx):
        dp_rank = self.trainer.strategy.distributed_sampler_kwargs["rank"]
        self.log("dp_rank_sum", float(dp_rank), sync_dist=True, reduce_fx="sum", on_step=True, on_epoch=False)
        self.dp_rank_metric.update(torch.tensor(float(dp_rank + 1)))
        return super().training_step(batch, batch_idx)


def sync_case():
    world = world_size()
    tp = 2 if world % 2 == 0 else 1
    dp = world // tp
    module = SyncModule()
    trainer = trainer_for(FSDPTensorParallelStrategy(tensor_parallel_size=tp, tp_plan=TP_PLAN))
    trainer.fit(module, loader(RegressionData(), BATCH))
    metric_total = module.dp_rank_metric.compute().item()  # collective over the metric's process group
    reduced = trainer.strategy.reduce(torch.tensor(1.0), reduce_op="sum").item()
    return {
        "dp": dp,
        "logged_dp_rank_sum": trainer.callback_metrics["dp_rank_sum"].item(),
        "metric_total": metric_total,
        "reduce_sum_of_ones": reduced,
        "steps": STEPS,
    }


def ignored_case():
    """`ignored_modules`: their gradients are not synchronised, so their params drift apart across ranks."""
    world = world_size()
    data = RegressionData()
    module = ParityModule()
    trainer = trainer_for(ReplicateStrategy(ignored_modules=["model.out"]))
    trainer.fit(module, loader(data, BATCH))
    local = {k: v.detach().clone() for k, v in module.state_dict().items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    synced = [k for k in local if not k.startswith("model.out.")]
    return {
        "synced_max_diff_across_ranks": max(
            (g[k] - gathered[0][k]).abs().max().item() for g in gathered for k in synced
        ),
        "ignored_max_diff_across_ranks": max(
            (g[k] - gathered[0][k]).abs().max().item() for g in gathered for k in local if k not in synced
        ),
    }


class AttributePlanModule(ParityModule):
    tp_plan = TP_PLAN


class ModelParallelStyleModule(ParityModule):
    """Written for Lightning's `ModelParallelStrategy`: parallelises itself in `configure_model`."""

    def configure_model(self):
        if isinstance(self.model, FSDPModule):
            return  # already parallelised by an earlier fit (Lightning calls configure_model every run)
        tp_mesh = self.device_mesh["tensor_parallel"]
        dp_mesh = self.device_mesh["data_parallel"]
        for layer in self.model.layers:
            parallelize_module(layer, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(self.model, mesh=dp_mesh)


class TPOnlyConfigureModelModule(ParityModule):
    """Applies TP itself and leaves data parallelism to the strategy."""

    def configure_model(self):
        if any(isinstance(p, DTensor) for p in self.parameters()):
            return
        tp_mesh = self.device_mesh["tensor_parallel"]
        for layer in self.model.layers:
            parallelize_module(layer, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


def _parity(make_module, make_strategy, dp):
    data = RegressionData()
    trainer = trainer_for(make_strategy())
    trainer.fit(make_module(), loader(data, BATCH))
    got = full_params(trainer)
    if trainer.global_rank != 0:
        return None
    want = reference_train("sgd", global_batches(data, dp, BATCH, STEPS))
    return {"max_abs_diff": max((got[k] - want[k]).abs().max().item() for k in want)}


def group_plan_sources() -> Iterator[Case]:
    tp = 2
    dp = world_size() // tp

    def tp_only():
        return FSDPTensorParallelStrategy(tensor_parallel_size=tp)

    yield Case("plan_from_attribute", lambda: _parity(AttributePlanModule, tp_only, dp))
    yield Case("plan_from_configure_model", lambda: _parity(ModelParallelStyleModule, tp_only, dp))
    # The registered name with its defaults: tensor_parallel_size="auto" is one node (all local ranks).
    yield Case("registered_name_auto_sizes", lambda: _parity(AttributePlanModule, lambda: "dpar_2d", dp=1))
    yield Case(
        "2d_hsdp",
        lambda: _parity(
            ParityModule,
            lambda: FSDPTensorParallelStrategy(tensor_parallel_size=tp, replicate_size=dp, tp_plan=TP_PLAN),
            dp,
        ),
    )
    yield Case("tp_only_configure_model", lambda: _parity(TPOnlyConfigureModelModule, tp_only, dp))


class EvalModule(ParityModule):
    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return x, self(x)


def fit_then_eval_case():
    """fit, then validate/test/predict on the same Trainer: parallelism applied once, evaluation on trained weights."""
    world = world_size()
    tp = 2 if world % 2 == 0 else 1
    dp = world // tp
    data, val = RegressionData(), RegressionData(n=32, seed=99)
    module = EvalModule()
    trainer = trainer_for(FSDPTensorParallelStrategy(tensor_parallel_size=tp, tp_plan=TP_PLAN))
    trainer.fit(module, loader(data, BATCH))
    units_after_fit = sum(isinstance(m, FSDPModule) for m in module.modules())
    val_loss = trainer.validate(module, loader(val, BATCH), verbose=False)[0]["val_loss"]
    test_loss = trainer.test(module, loader(val, BATCH), verbose=False)[0]["test_loss"]
    predictions = trainer.predict(module, loader(val, BATCH))
    units_after_eval = sum(isinstance(m, FSDPModule) for m in module.modules())

    reference = Net()
    want = reference_train("sgd", global_batches(data, dp, BATCH, STEPS))
    reference.load_state_dict({k.removeprefix("model."): v for k, v in want.items()})
    with torch.no_grad():
        ref_loss = F.mse_loss(reference(val.x), val.y).item()
        predict_diff = max((y_hat - reference(x)).abs().max().item() for x, y_hat in predictions)
    predict_diffs = [None] * world
    dist.all_gather_object(predict_diffs, predict_diff)
    return {
        "units_after_fit": units_after_fit,
        "units_after_eval": units_after_eval,
        "val_loss_diff": abs(val_loss - ref_loss),
        "test_loss_diff": abs(test_loss - ref_loss),
        "predict_max_diff": max(predict_diffs),
    }


class ConfigureModelOnMeta(ParityModule):
    """Builds its model in `configure_model` on the meta device: no rank may ever hold it in full."""

    def __init__(self) -> None:
        super().__init__()
        del self.model

    def configure_model(self):
        if hasattr(self, "model"):
            return
        with torch.device("meta"):
            self.model = Net()
        self.built_on_meta = all(p.is_meta for p in self.model.parameters())


def _shard_report(module, trainer):
    full_numel = {k: v.numel() for k, v in Net().named_parameters()}
    local = {}
    for name, p in module.model.named_parameters():
        assert isinstance(p, DTensor), name
        local[name] = p.to_local().numel()
    losses = trainer.callback_metrics["train_loss"].item()
    return {
        "largest_local_fraction": max(local[k] / full_numel[k] for k in local),
        "any_meta": any(p.is_meta for p in module.parameters()),
        "all_finite": all(torch.isfinite(p.to_local()).all().item() for p in module.parameters()),
        "train_loss_finite": bool(torch.isfinite(torch.tensor(losses))),
    }


def meta_configure_model_case():
    module = ConfigureModelOnMeta()
    trainer = trainer_for(FullyShardStrategy())
    trainer.fit(module, loader(RegressionData(), BATCH))
    return {"built_on_meta": module.built_on_meta, **_shard_report(module, trainer), "world": world_size()}


def meta_init_module_case():
    world = world_size()
    trainer = trainer_for(FSDPTensorParallelStrategy(tensor_parallel_size=2 if world % 2 == 0 else 1, tp_plan=TP_PLAN))
    with trainer.init_module(empty_init=True):
        module = ParityModule()
    init_module_on_meta = all(p.is_meta for p in module.parameters())
    trainer.fit(module, loader(RegressionData(), BATCH))
    return {"built_on_meta": init_module_on_meta, **_shard_report(module, trainer)}


class GradVisibility(L.Callback):
    """Records, after each backward, whether any sharded gradient was produced (i.e. a reduce-scatter ran)."""

    def __init__(self) -> None:
        self.grads_present: list[bool] = []

    def on_after_backward(self, trainer, pl_module):
        self.grads_present.append(any(p.grad is not None for p in pl_module.parameters()))


def accumulate_no_sync_case():
    """Non-final micro-batches of gradient accumulation must not communicate gradients."""
    world = world_size()
    tp = 2 if world % 2 == 0 else 1
    visibility = GradVisibility()
    trainer = trainer_for(
        FSDPTensorParallelStrategy(tensor_parallel_size=tp, tp_plan=TP_PLAN),
        accumulate_grad_batches=2,
        callbacks=[visibility],
    )
    trainer.fit(ParityModule(), loader(RegressionData(), BATCH))
    calls: list[int] = []
    trainer = trainer_for(ReplicateStrategy(comm_hook=counting_allreduce_hook(calls)), accumulate_grad_batches=2)
    trainer.fit(ParityModule(), loader(RegressionData(), BATCH))
    return {
        "fsdp_grads_after_each_backward": visibility.grads_present,
        "replicate_hook_calls": len(calls),
        "steps": STEPS,
    }


GROUPS = {
    "sync": one_case("sync", sync_case),
    "ignored": one_case("ignored", ignored_case),
    "plan_sources": group_plan_sources,
    "fit_then_eval": one_case("fit_then_eval", fit_then_eval_case),
    "meta_init": lambda: [
        Case("meta_configure_model", meta_configure_model_case),
        Case("meta_init_module", meta_init_module_case),
    ],
    "accumulate_no_sync": one_case("accumulate_no_sync", accumulate_no_sync_case),
}
