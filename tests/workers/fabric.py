"""Cases for `tests/launched/test_fabric.py`: the strategies under a real Lightning Fabric loop on gloo ranks.

Each parity case trains `FabricNet` (the parity tests' `Net` under a `model` attribute, so its keys are the
Trainer's `ParityModule`'s) with `fabric.setup`, `fabric.backward`, `fabric.no_backward_sync` and
`fabric.clip_gradients`, on the batches `fabric.setup_dataloaders`' sampler gives each data-parallel rank, and
returns the largest difference of the gathered parameters to one process trained on the same global batches."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import lightning_dpar.fabric as dpar_fabric
from lightning_dpar.checkpoint.consolidate import main as consolidate
from tests.support.models import (
    TP_PLAN,
    Net,
    ParityModule,
    RegressionData,
    global_batches,
    loader,
    make_optimizer,
    reference_train,
)
from tests.workers.cases import Case
from tests.workers.common import BATCH, STEPS, full_params, trainer_for, world_size

#: Where the 4-rank save of `save_4` is written and the 2-rank `load_2` reads it (set by the test).
#: Items of one global batch in the explicit-batch cases (both 4 and 2 data-parallel ranks divide it).
GLOBAL_BATCH = 8


class FabricNet(nn.Module):
    """`ParityModule`'s model without Lightning: the same initial weights (seed 0) and keys (`model.*`)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Net(depth=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def fabric_for(strategy: Any, precision: str = "32-true") -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=world_size(), strategy=strategy, precision=precision)
    fabric.launch()
    return fabric


def gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole parameters on every rank (a collective)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False))
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def reference(optimizer: str, batches: list[tuple[torch.Tensor, torch.Tensor]], clip_norm: float | None = None):
    """One process on the same global batches: the ground truth (`FabricNet`'s keys are `reference_train`'s)."""
    return reference_train(optimizer, batches, clip_norm=clip_norm)


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want), (sorted(got), sorted(want))
    return max((got[k] - want[k]).abs().max().item() for k in want)


def parity(
    make_strategy: Callable[[], Any],
    dp: int,
    optimizer: str = "adamw",
    accumulate: int = 1,
    clip_norm: float | None = None,
    together: bool = True,
) -> dict | None:
    """A Fabric loop against one process: `accumulate` micro-batches per step (all but the last inside
    `no_backward_sync`), the loss divided by `accumulate`, gradients clipped by norm before each step."""
    fabric = fabric_for(make_strategy())
    model = FabricNet()
    if together:  # the optimizer built on the whole model, re-pointed at the shards by `setup`
        model, opt = fabric.setup(model, make_optimizer(optimizer, model.parameters()))
    else:  # LitGPT's order: the model, then an optimizer on its shards
        model = fabric.setup(model)
        opt = fabric.setup_optimizers(make_optimizer(optimizer, model.parameters()))
    data = RegressionData()
    batches = iter(fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)))
    norms = []
    for _ in range(STEPS):
        for micro in range(accumulate):
            x, y = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                fabric.backward(F.mse_loss(model(x), y) / accumulate)
        if clip_norm is not None:
            norms.append(fabric.clip_gradients(model, opt, max_norm=clip_norm).item())
        opt.step()
        opt.zero_grad()
    got = gathered(model)
    if fabric.global_rank != 0:
        return None
    want = reference(optimizer, global_batches(data, dp, BATCH, STEPS, accumulate), clip_norm)
    return {"max_abs_diff": max_diff(got, want), "clipped": bool(norms) and max(norms) > clip_norm}


def explicit_batches(start: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches `start..start+steps` of `RegressionData`, in order."""
    data = RegressionData()
    return [
        (data.x[s * GLOBAL_BATCH : (s + 1) * GLOBAL_BATCH], data.y[s * GLOBAL_BATCH : (s + 1) * GLOBAL_BATCH])
        for s in range(start, start + steps)
    ]


def train_explicit(fabric: Fabric, model: nn.Module, opt: Any, start: int, steps: int) -> None:
    """Steps on explicit global batches, each data-parallel rank taking its contiguous part."""
    kwargs = fabric.strategy.distributed_sampler_kwargs
    dp, rank = kwargs["num_replicas"], kwargs["rank"]
    for x, y in explicit_batches(start, steps):
        part = slice(rank * GLOBAL_BATCH // dp, (rank + 1) * GLOBAL_BATCH // dp)
        fabric.backward(F.mse_loss(model(x[part]), y[part]))
        opt.step()
        opt.zero_grad()


def save_4() -> dict | None:
    """2D (TP 2 x FSDP 2) trains 2 steps with Adam and saves, as a sharded checkpoint, for `fabric_load_2`."""
    path = _shared_tmp("save_4_load_2")
    fabric = fabric_for(dpar_fabric.FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=TP_PLAN))
    model = fabric.setup(FabricNet())
    opt = fabric.setup_optimizers(make_optimizer("adam", model.parameters()))
    train_explicit(fabric, model, opt, 0, 2)
    fabric.save(path / "fabric.ckpt", {"model": model, "optimizer": opt, "step": 2})
    return {"files": sorted(p.name for p in (path / "fabric.ckpt").iterdir())} if fabric.global_rank == 0 else None


def load_2() -> dict | None:
    """The 4-rank save loaded on 2 ranks as FSDP 2 into a model built on the meta device, then 2 more steps: equal
    to one process's 4 steps."""
    path = _shared_tmp("save_4_load_2")
    fabric = fabric_for("dpar_fsdp")
    with fabric.init_module(empty_init=True):
        model = FabricNet()
    on_meta = all(p.is_meta for p in model.parameters())
    model = fabric.setup(model)
    opt = fabric.setup_optimizers(make_optimizer("adam", model.parameters()))
    state = {"model": model, "optimizer": opt, "step": 0}
    remainder = fabric.load(path / "fabric.ckpt", state)
    train_explicit(fabric, model, opt, state["step"], 2)
    got = gathered(model)
    if fabric.global_rank != 0:
        return None
    return {
        "built_on_meta": on_meta,
        "step": state["step"],
        "remainder": sorted(remainder),
        "max_abs_diff": max_diff(got, reference("adam", explicit_batches(0, 4))),
    }


def trainer_to_fabric(tmp: Path) -> dict | None:
    """A Trainer run (FSDP) saves; Fabric (replicate, another layout) loads it and continues: equal to one process
    on the Trainer's batches then Fabric's."""
    dp = world_size()
    data = RegressionData()
    trainer = trainer_for("dpar_fsdp")
    trainer.fit(ParityModule(optimizer="adam"), loader(data, BATCH))
    trained = full_params(trainer)
    trainer.save_checkpoint(tmp / "trainer.ckpt")
    fabric = fabric_for("dpar_replicate")
    model = fabric.setup(FabricNet())
    opt = fabric.setup_optimizers(make_optimizer("adam", model.parameters()))
    remainder = fabric.load(tmp / "trainer.ckpt", {"model": model, "optimizer": opt})
    loaded = gathered(model)
    train_explicit(fabric, model, opt, 0, 2)
    got = gathered(model)
    if fabric.global_rank != 0:
        return None
    batches = global_batches(data, dp, BATCH, STEPS) + explicit_batches(0, 2)
    return {
        "loaded_equals_trained": max_diff(loaded, trained),
        "trainer_keys_left": "global_step" in remainder and "loops" in remainder,
        "max_abs_diff": max_diff(got, reference("adam", batches)),
    }


def fabric_to_trainer(tmp: Path) -> dict | None:
    """Fabric (TP 2 x FSDP) saves; a Trainer (FSDP) validates from it with the same weights, and `consolidate`
    reads it into one file of the same tensors."""
    fabric = fabric_for(dpar_fabric.FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=TP_PLAN))
    model = fabric.setup(FabricNet())
    opt = fabric.setup_optimizers(make_optimizer("adam", model.parameters()))
    train_explicit(fabric, model, opt, 0, 2)
    saved = gathered(model)
    fabric.save(tmp / "fabric.ckpt", {"model": model, "optimizer": opt, "step": 2})
    trainer = trainer_for("dpar_fsdp")
    module = ParityModule(optimizer="adam")
    trainer.validate(module, loader(RegressionData(), BATCH), ckpt_path=str(tmp / "fabric.ckpt"), verbose=False)
    in_trainer = full_params(trainer)
    result = None
    if trainer.global_rank == 0:
        assert consolidate([str(tmp / "fabric.ckpt"), str(tmp / "fabric.pt")]) == 0
        whole = torch.load(tmp / "fabric.pt", weights_only=True)["state_dict"]
        result = {
            "trainer_equals_saved": max_diff(in_trainer, saved),
            "consolidated_equals_saved": max_diff(whole, saved),
        }
    dist.barrier()
    return result


def _shared_tmp(name: str) -> Path:
    """A directory every rank names alike: in the launch's work directory (the parent of its results directory, which
    `fabric_save_4` and `fabric_load_2` share as launches of one test)."""
    path = Path(sys.argv[2]).resolve().parent / "fabric" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def _messages(fn: Callable[[], Any]) -> list[str | None]:
    """Every rank's error (None where it did not raise), gathered on every rank."""
    message = None
    try:
        fn()
    except Exception as error:
        message = f"{type(error).__name__}: {error}"
    messages: list[str | None] = [None] * world_size()
    dist.all_gather_object(messages, message)
    return messages


def group_fabric() -> Iterator[Case]:
    world = world_size()
    yield Case("fabric_fsdp", lambda: parity(lambda: "dpar_fsdp", world, accumulate=2, clip_norm=0.05))
    yield Case("fabric_fsdp_apart", lambda: parity(lambda: "dpar_fsdp", world, "sgd", together=False))
    yield Case("fabric_replicate", lambda: parity(lambda: "dpar_replicate", world, accumulate=2, clip_norm=0.05))
    if world % 2 == 0:
        hsdp = dpar_fabric.FullyShardStrategy
        yield Case("fabric_hsdp", lambda: parity(lambda: hsdp(replicate_size=2), world, accumulate=2, clip_norm=0.05))
        tp2 = dpar_fabric.FSDPTensorParallelStrategy
        yield Case(
            "fabric_tp2",
            lambda: parity(
                lambda: tp2(tensor_parallel_size=2, tp_plan=TP_PLAN), world // 2, accumulate=2, clip_norm=0.05
            ),
        )
        yield Case(
            "fabric_replicate_tp2",
            lambda: parity(
                lambda: dpar_fabric.ReplicateStrategy(tensor_parallel_size=2, tp_plan=TP_PLAN),
                world // 2,
                accumulate=2,
                clip_norm=0.05,
            ),
        )
    yield Case("fabric_trainer_to_fabric", lambda: trainer_to_fabric(_shared_tmp("trainer_to_fabric")))
    if world % 2 == 0:
        yield Case("fabric_fabric_to_trainer", lambda: fabric_to_trainer(_shared_tmp("fabric_to_trainer")))


def group_fabric_refusals() -> Iterator[Case]:
    def refused(name: str, fn: Callable[[], Any]) -> Case:
        return Case(name, lambda: _messages(fn))

    yield refused(
        "fabric_refuses_pipeline", lambda: Fabric(accelerator="cpu", devices=world_size(), strategy="dpar_3d")
    )
    yield refused("fabric_refuses_context_parallel", lambda: fabric_for("dpar_cp"))
    yield refused(
        "fabric_refuses_bad_tp_size", lambda: fabric_for(dpar_fabric.FSDPTensorParallelStrategy(tensor_parallel_size=3))
    )
    yield refused(
        "fabric_refuses_unmatched_plan",
        lambda: fabric_for(
            dpar_fabric.FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan={"model.layers.*.fc9": "colwise"})
        ).setup(FabricNet()),
    )
    yield refused("fabric_refuses_fp16", lambda: fabric_for("dpar_fsdp", precision="16-true"))

    def stepped_optimizer() -> None:
        model = FabricNet()
        opt = make_optimizer("adam", model.parameters())
        F.mse_loss(model(torch.ones(2, 5)), torch.zeros(2, 5)).backward()
        opt.step()
        fabric_for("dpar_fsdp").setup(model, opt)

    yield refused("fabric_refuses_stepped_optimizer", stepped_optimizer)


def moe_parity(make: Callable[[], nn.Module], loss: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> dict | None:
    """A MoE model under `FullyShardStrategy(expert_parallel_size=world)` in a Fabric loop (accumulating 2
    micro-batches, clipping) against one process; `loss(model, batch)` calls the model through its forward (for a
    transformers MoE with `output_router_logits`, the load-balancing loss over the global batch)."""
    from tests.workers.hf_models import TokenIds
    from tests.workers.hf_models import global_batches as token_batches

    world = world_size()
    fabric = fabric_for(dpar_fabric.FullyShardStrategy(expert_parallel_size=world))
    model = make()
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    data = TokenIds()
    batches = iter(fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=BATCH // 2, shuffle=True)))
    for _ in range(STEPS):
        for micro in range(2):
            with fabric.no_backward_sync(model, enabled=micro == 0):
                fabric.backward(loss(model, next(batches)) / 2)
        fabric.clip_gradients(model, opt, max_norm=0.5)
        opt.step()
        opt.zero_grad()
    got = gathered(model)
    if fabric.global_rank != 0:
        return None
    reference_model = make()
    reference_opt = torch.optim.SGD(reference_model.parameters(), lr=0.5, momentum=0.9)
    micro = token_batches(data, world, 0, STEPS)  # each of `world` ranks' BATCH-sized slice, one per step
    for step in range(STEPS):  # micro-batch m of the step: every rank's m-th half, as the ranks ran it
        for m in range(2):
            rows = torch.cat([micro[step][rank * BATCH : (rank + 1) * BATCH].chunk(2)[m] for rank in range(world)])
            (loss(reference_model, rows) / 2).backward()
        torch.nn.utils.clip_grad_norm_(reference_model.parameters(), 0.5)
        reference_opt.step()
        reference_opt.zero_grad()
    want = {k: v.detach().clone() for k, v in reference_model.state_dict().items()}
    return {"max_abs_diff": max_diff(got, want)}


def _example_moe() -> nn.Module:
    from tests.workers.moe import ExampleMoE

    return ExampleMoE()


def _example_moe_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


class _Held(nn.Module):
    """A model under a `net` attribute, as the Trainer's `HFMoEModule` holds it."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, **kwargs: Any) -> Any:
        return self.net(**kwargs)


def _qwen3_moe_with_router_loss() -> nn.Module:
    from tests.workers.moe import HFMoEModule

    return _Held(HFMoEModule(output_router_logits=True, router_aux_loss_coef=0.1).net)


def group_fabric_moe() -> Iterator[Case]:
    yield Case("fabric_example_moe_ep", lambda: moe_parity(_example_moe, _example_moe_loss))
    yield Case(
        "fabric_refuses_bare_moe_with_router_loss",
        lambda: _messages(lambda: fabric_for("dpar_ep").setup(_qwen3_moe_with_router_loss().net)),
    )
    yield Case(
        "fabric_qwen3_moe_router_loss_ep",
        lambda: moe_parity(_qwen3_moe_with_router_loss, lambda model, batch: model(input_ids=batch, labels=batch).loss),
    )


def group_fabric_save_4() -> Iterator[Case]:
    yield Case("fabric_save_4", save_4)


def group_fabric_load_2() -> Iterator[Case]:
    yield Case("fabric_load_2", load_2)


GROUPS = {
    "fabric": group_fabric,
    "fabric_refusals": group_fabric_refusals,
    "fabric_save_4": group_fabric_save_4,
    "fabric_load_2": group_fabric_load_2,
    "fabric_moe": group_fabric_moe,
}
