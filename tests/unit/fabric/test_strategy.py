"""The Fabric front door (`lightning_dpar/fabric/strategy.py`), in-process: a real `Fabric(devices=1)` on a real
one-rank gloo group (`gloo_world`), so setup, the loop's hooks and the checkpoint calls run in the fast lane. The
same code on 2 and 4 ranks, with every layout's parity, is `tests/launched/test_fabric.py`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry
from torch.distributed.tensor import DTensor

import lightning_dpar
from lightning_dpar.fabric import register_fabric_strategies
from lightning_dpar.fabric.strategy import (
    DparFabricStrategy,
    FSDPTensorParallelStrategy,
    FullyShardStrategy,
    ReplicateStrategy,
)
from lightning_dpar.optim.nonfinite import NonFiniteError
from tests.support.models import TP_PLAN, ParityModule, RegressionData, global_batches, loader, make_optimizer
from tests.workers.common import BATCH, STEPS, full_params, trainer_for
from tests.workers.fabric import FabricNet, reference

STRATEGIES = {
    "dpar_fsdp": FullyShardStrategy,
    "dpar_hsdp": FullyShardStrategy,
    "dpar_2d": FSDPTensorParallelStrategy,
    "dpar_replicate": ReplicateStrategy,
}


def _fabric(strategy, precision: str = "32-true") -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, precision=precision)
    fabric.launch()
    return fabric


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = RegressionData()
    return [(data.x[s * 4 : (s + 1) * 4], data.y[s * 4 : (s + 1) * 4]) for s in range(steps)]


def _train(fabric: Fabric, model, optimizer, batches, clip: float | None = None) -> None:
    for x, y in batches:
        fabric.backward(F.mse_loss(model(x), y))
        if clip is not None:
            fabric.clip_gradients(model, optimizer, max_norm=clip)
        optimizer.step()
        optimizer.zero_grad()


def _whole(model) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }


def _max_diff(got, want) -> float:
    assert set(got) == set(want)
    return max((got[k] - want[k]).abs().max().item() for k in want)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_importing_the_package_registers_the_trainers_names_in_fabrics_registry(name):
    assert STRATEGY_REGISTRY[name]["strategy"] is STRATEGIES[name]
    assert STRATEGY_REGISTRY[name]["init_params"] == StrategyRegistry[name]["init_params"]
    assert STRATEGY_REGISTRY[STRATEGIES[name].__name__.lower()]["strategy"] is STRATEGIES[name]


def test_registering_again_is_harmless_and_leaves_the_trainer_only_strategies_out():
    register_fabric_strategies()
    assert "dpar_auto" in StrategyRegistry and "dpar_auto" not in STRATEGY_REGISTRY
    assert "dpar_ft_hsdp" in StrategyRegistry and "dpar_ft_hsdp" not in STRATEGY_REGISTRY


def test_each_fabric_strategy_drives_the_trainer_strategy_of_the_same_arguments():
    strategy = FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=TP_PLAN, async_save=True)
    assert isinstance(strategy, DparFabricStrategy)
    assert type(strategy.engine) is lightning_dpar.FSDPTensorParallelStrategy
    assert (
        strategy.engine.plan_options
        == lightning_dpar.FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=TP_PLAN).plan_options
    )
    assert strategy.async_save


@pytest.mark.parametrize("name", ["dpar_fsdp", "dpar_replicate", "dpar_2d"])
def test_one_rank_loop_trains_like_plain_torch(gloo_world, name):
    strategy = FSDPTensorParallelStrategy(tensor_parallel_size=1, tp_plan=TP_PLAN) if name == "dpar_2d" else name
    fabric = _fabric(strategy)
    model = FabricNet()
    model, optimizer = fabric.setup(model, make_optimizer("adamw", model.parameters()))
    batches = _batches(3)
    _train(fabric, model, optimizer, batches, clip=0.05)
    assert _max_diff(_whole(model), reference("adamw", batches, clip_norm=0.05)) < 1e-5


def test_empty_init_builds_on_meta_and_setup_materialises_the_shards(gloo_world):
    fabric = _fabric("dpar_fsdp")
    with fabric.init_module(empty_init=True):
        model = FabricNet()
    assert all(p.is_meta for p in model.parameters())
    model = fabric.setup(model)
    assert all(isinstance(p, DTensor) and not p.is_meta for p in model.parameters())
    assert all(bool(torch.isfinite(p.full_tensor()).all()) for p in model.parameters())


def test_save_then_load_restores_the_model_the_optimizer_and_the_rest(gloo_world, tmp_path):
    fabric = _fabric("dpar_fsdp")
    model = fabric.setup(FabricNet())
    optimizer = fabric.setup_optimizers(make_optimizer("adam", model.parameters()))
    _train(fabric, model, optimizer, _batches(2))
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer, "step": 2})
    saved = _whole(model)
    _train(fabric, model, optimizer, _batches(1))  # moves away from the save
    state = {"model": model, "optimizer": optimizer, "step": 0}
    remainder = fabric.load(tmp_path / "ckpt", state)
    assert state["step"] == 2 and "step" not in remainder
    assert _max_diff(_whole(model), saved) == 0.0
    _train(fabric, model, optimizer, _batches(4)[2:])
    assert _max_diff(_whole(model), reference("adam", _batches(4))) < 1e-5


def test_load_asks_for_a_key_the_checkpoint_lacks(gloo_world, tmp_path):
    fabric = _fabric("dpar_fsdp")
    model = fabric.setup(FabricNet())
    fabric.save(tmp_path / "ckpt", {"model": model})
    with pytest.raises(KeyError, match=r"has no \['step'\]"):
        fabric.load(tmp_path / "ckpt", {"model": model, "step": 0})
    state = {"model": model, "step": 0}
    fabric.load(tmp_path / "ckpt", state, strict=False)
    assert state["step"] == 0


def test_save_refuses_a_filter_and_a_second_model(gloo_world, tmp_path):
    fabric = _fabric("dpar_fsdp")
    model = fabric.setup(FabricNet())
    with pytest.raises(TypeError, match="neither `storage_options` nor `filter`"):
        fabric.save(tmp_path / "ckpt", {"model": model}, filter={"model": lambda k, v: True})
    with pytest.raises(ValueError, match="already set one up"):
        fabric.setup(FabricNet())


def test_no_backward_sync_switches_the_engines_gradient_sync_off_and_back(gloo_world):
    fabric = _fabric("dpar_fsdp")
    model = fabric.setup(FabricNet())
    engine = fabric.strategy.engine
    with fabric.no_backward_sync(model):
        assert engine._backward_sync_blocked
    assert not engine._backward_sync_blocked
    with fabric.no_backward_sync(model, enabled=False):
        assert not engine._backward_sync_blocked


def test_a_nonfinite_loss_raises_at_the_step(gloo_world):
    fabric = _fabric("dpar_fsdp")
    model = fabric.setup(FabricNet())
    optimizer = fabric.setup_optimizers(make_optimizer("sgd", model.parameters()))
    x, y = _batches(1)[0]
    fabric.backward(F.mse_loss(model(x), y) * float("nan"))
    with pytest.raises(NonFiniteError):
        optimizer.step()


def test_bf16_mixed_is_the_engines_precision(gloo_world):
    fabric = _fabric("dpar_fsdp", precision="bf16-mixed")
    assert fabric.strategy.precision is fabric.strategy.engine.precision_plugin
    assert fabric.strategy.precision.precision == "bf16-mixed"


def test_an_async_save_is_complete_after_wait_and_loads(gloo_world, tmp_path):
    fabric = _fabric(FullyShardStrategy(async_save=True))
    model = fabric.setup(FabricNet())
    optimizer = fabric.setup_optimizers(make_optimizer("adam", model.parameters()))
    _train(fabric, model, optimizer, _batches(2))
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer, "step": 2})
    saved = _whole(model)
    fabric.strategy.wait_for_checkpoint()
    assert (tmp_path / "ckpt" / ".metadata").is_file()  # under its final name once waited for
    _train(fabric, model, optimizer, _batches(1))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(tmp_path / "ckpt", state)
    assert state["step"] == 2 and _max_diff(_whole(model), saved) == 0.0


def test_a_full_checkpoint_is_one_file_that_a_sharded_layout_loads(gloo_world, tmp_path):
    fabric = _fabric(ReplicateStrategy(checkpoint_format="full"))
    model = fabric.setup(FabricNet())
    optimizer = fabric.setup_optimizers(make_optimizer("adam", model.parameters()))
    _train(fabric, model, optimizer, _batches(2))
    fabric.save(tmp_path / "full.ckpt", {"model": model, "optimizer": optimizer})
    assert (tmp_path / "full.ckpt").is_file()
    whole = torch.load(tmp_path / "full.ckpt", weights_only=True)["state_dict"]
    assert _max_diff(whole, _whole(model)) == 0.0


@pytest.mark.parametrize("name", ["dpar_fsdp", "dpar_replicate"])
def test_bf16_mixed_under_fabric_is_the_trainers_bf16_mixed(gloo_world, name):
    """The same precision code path: FSDP2's MixedPrecisionPolicy (bf16 compute, fp32 master weights and gradient
    reduction) under `dpar_fsdp`, autocast under `dpar_replicate`; the Trainer's result, to the bit."""
    data = RegressionData()
    trainer = trainer_for(name, devices=1, precision="bf16-mixed")
    trainer.fit(ParityModule(optimizer="sgd"), loader(data, BATCH))
    want = full_params(trainer)
    fabric = _fabric(name, precision="bf16-mixed")
    model = fabric.setup(FabricNet())
    optimizer = fabric.setup_optimizers(make_optimizer("sgd", model.parameters()))
    _train(fabric, model, optimizer, global_batches(data, 1, BATCH, STEPS))
    got = _whole(model)
    assert all(v.dtype == torch.float32 for v in got.values())
    assert _max_diff(got, want) == 0.0
    assert _max_diff(got, reference("sgd", global_batches(data, 1, BATCH, STEPS))) > 0  # bf16 compute: not fp32's
