"""What every strategy shares (`lightning_dpar/strategies/base.py`), in-process: a real `Trainer(devices=1)` on a real
one-rank gloo group (`gloo_world`), so setup, the steps, evaluation and the checkpoint hooks run here in the fast
lane. The same code on 2 and 4 ranks is in the launched tests (`tests/launched/test_parity.py`,
`tests/launched/test_checkpoint.py`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, ReplicateStrategy
from tests.support.models import TP_PLAN, ParityModule, RegressionData, global_batches, loader, reference_train
from tests.workers.common import BATCH, full_params, trainer_for

STRATEGIES = {
    "fsdp": lambda **kw: FullyShardStrategy(**kw),
    # One rank holds no tensor-parallel peer: this is the 2-D strategy's own setup with its TP plan on a mesh whose
    # tensor-parallel dim has size 1 (the TP parity on 2 and 4 ranks is `tests/launched/test_parity.py`).
    "2d_on_one_rank": lambda **kw: FSDPTensorParallelStrategy(tensor_parallel_size=1, tp_plan=TP_PLAN, **kw),
    "replicate": lambda **kw: ReplicateStrategy(**kw),
    "fsdp_checkpointed": lambda **kw: FullyShardStrategy(activation_checkpointing=True, **kw),
}


def _fit(strategy, steps: int = 3, module=None, **trainer_kwargs):
    module = module if module is not None else ParityModule()
    trainer = trainer_for(strategy, max_steps=steps, devices=1, **trainer_kwargs)
    trainer.fit(module, loader(RegressionData(), BATCH))
    return trainer, module


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want)
    return max((got[k] - want[k]).abs().max().item() for k in want)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_trains_like_one_process_on_the_sampler_order(gloo_world, name):
    trainer, module = _fit(STRATEGIES[name]())
    want = reference_train("sgd", global_batches(RegressionData(), 1, BATCH, 3))
    assert _max_diff(full_params(trainer), want) < 1e-6
    assert trainer.global_step == 3 and trainer.strategy.world_size == 1
    sharded = name != "replicate"
    assert isinstance(module.model.layers[0].fc1.weight, DTensor) is sharded


class _Predicting(ParityModule):
    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y), sync_dist=True)


@pytest.mark.parametrize("name", ["fsdp", "2d_on_one_rank", "replicate"])
def test_validate_test_and_predict_use_the_trained_weights(gloo_world, name):
    trainer, module = _fit(STRATEGIES[name](), module=_Predicting())
    reference = ParityModule()
    reference.load_state_dict(full_params(trainer))
    data = RegressionData(n=8)
    with torch.no_grad():
        want = reference(data.x)
    want_loss = F.mse_loss(want, data.y).item()
    (validated,) = trainer.validate(module, loader(data, 8), verbose=False)
    assert validated["val_loss"] == pytest.approx(want_loss, abs=1e-6)
    (tested,) = trainer.test(module, loader(data, 8), verbose=False)
    assert tested["test_loss"] == pytest.approx(want_loss, abs=1e-6)
    predicted = trainer.predict(module, loader(torch.utils.data.TensorDataset(data.x), 4))
    torch.testing.assert_close(torch.cat(predicted), want, rtol=0, atol=1e-6)


def test_gradient_accumulation_and_clipping_match_one_process(gloo_world):
    trainer, _ = _fit(
        STRATEGIES["fsdp"](), accumulate_grad_batches=2, gradient_clip_val=0.05, gradient_clip_algorithm="norm"
    )
    want = reference_train("sgd", global_batches(RegressionData(), 1, BATCH, 3, accumulate=2), clip_norm=0.05)
    assert _max_diff(full_params(trainer), want) < 1e-6


class _DirectParameter(ParityModule):
    """A parameter on the LightningModule itself (DDP wraps children only), and a layer frozen at wrap time that a
    callback unfreezes after the first step."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(5))
        self.model.inp.requires_grad_(False)

    def forward(self, x):
        return self.model(x) * self.scale

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx == 1:
            self.model.inp.requires_grad_(True)


def test_replicate_trains_direct_and_late_unfrozen_parameters_like_one_process(gloo_world):
    trainer, module = _fit(STRATEGIES["replicate"](), module=_DirectParameter())
    reference = _DirectParameter()
    optimizer = reference.configure_optimizers()
    for step, (x, y) in enumerate(global_batches(RegressionData(), 1, BATCH, 3)):
        reference.on_train_batch_start(None, step)
        optimizer.zero_grad()
        F.mse_loss(reference(x), y).backward()
        optimizer.step()
    assert _max_diff(full_params(trainer), reference.state_dict()) < 1e-6
    assert not torch.equal(module.scale.detach(), torch.ones(5))  # it trained


def test_collectives_of_a_one_rank_world(gloo_world):
    trainer, _ = _fit(STRATEGIES["2d_on_one_rank"](), steps=1)
    strategy = trainer.strategy
    assert strategy.data_parallel_group is strategy.meshes.data_parallel.get_group()
    assert strategy.broadcast({"a": 1}) == {"a": 1}
    assert strategy.reduce(torch.tensor(3.0), reduce_op="mean").item() == 3.0
    assert strategy.all_gather(torch.tensor([1.0, 2.0])).tolist() == [[1.0, 2.0]]
    assert strategy.reduce_boolean_decision(True) and not strategy.reduce_boolean_decision(False, all=False)
    strategy.barrier("after")
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}
    assert strategy.device_mesh.mesh_dim_names is not None and strategy.device_mesh.size() == 1


@pytest.mark.parametrize(("rank", "dp_rank"), [(0, 0), (1, 0), (2, 1), (3, 1)])
def test_the_data_parallel_group_is_not_the_world_under_tensor_parallelism(fake_world, rank, dp_rank):
    """On one rank the data-parallel group is the world's; on 4 ranks with TP 2 (a fake process group: mesh logic
    only) it holds the 2 ranks of other batches, and the sampler and metric reductions use it, not the world."""
    import torch.distributed as dist

    fake_world(4, rank)
    strategy = FSDPTensorParallelStrategy(tensor_parallel_size=2)
    strategy.meshes = strategy.resolve_dims(4, 4, 1).build_meshes(torch.device("cpu"))
    group = strategy.data_parallel_group
    assert group is not dist.group.WORLD and dist.get_world_size(group) == 2
    assert dist.get_process_group_ranks(group) == ([0, 2] if rank % 2 == 0 else [1, 3])
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": dp_rank}


class _GrowsInSetup(ParityModule):
    """Adds a layer in `LightningModule.setup`, after the strategy planned the model it was given."""

    def setup(self, stage: str) -> None:
        self.extra = nn.Linear(5, 5)

    def forward(self, x):
        return self.extra(self.model(x))


@pytest.mark.parametrize(("module_class", "plans"), [(ParityModule, 1), (_GrowsInSetup, 2)])
def test_the_plan_is_computed_once_unless_the_model_changed(gloo_world, monkeypatch, module_class, plans):
    """Planned before the process group and carried into `setup`; planned again only when a hook changed the model's
    structure in between, and then the plan applied is the new model's."""
    from lightning_dpar.parallel import parallelize

    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0])
        return plan_modules(*args, **kwargs)

    plan_modules = parallelize.plan_modules
    monkeypatch.setattr(parallelize, "plan_modules", counted)
    trainer, module = _fit(STRATEGIES["fsdp"](), steps=1, module=module_class())
    assert len(calls) == plans and all(c is module for c in calls)
    assert trainer.strategy.applied is not None and trainer.strategy.applied.plan is trainer.strategy.plan
    if plans == 2:
        assert isinstance(module.extra.weight, DTensor)  # the layer added in `setup` was planned and sharded
