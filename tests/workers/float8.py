"""float8 (`float8=`, torchao emulated on the CPU) cases for `tests/launched/test_float8.py`: a small MLP (Linear
layers of width 32 and 64, an output layer kept in high precision) trained through real Trainers under FSDP 2 (every
recipe), TP 2 and TP 2 x FSDP 2 (the rowwise recipes), each against one process running the same torchao
conversion of the same layers on each data-parallel rank's share of the batch, the gradients averaged (the
activations' scales are each rank's own, as under DDP); float8's noise floor, measured in the same one process;
and each refusal, raised alike on every rank.

torchao is imported inside the cases only: every launch imports this module, and torchao costs seconds."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, default_collate

import lightning_dpar.fabric as dpar_fabric
from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy
from tests.workers.cases import Case
from tests.workers.common import BATCH, STEPS, full_params, trainer_for, world_size

WIDTH, HIDDEN, OUT, ROWS = 32, 64, 16, 8
#: The hidden layers column- then row-wise (shards of 32 features: float8 matmuls take multiples of 16); the output
#: layer stays whole, and in high precision.
TP_PLAN = {"fc1": "colwise", "fc2": "rowwise", "fc3": "colwise", "fc4": "rowwise"}
CONVERTED = ["fc1", "fc2", "fc3", "fc4"]


class Vectors(Dataset):
    """`n` samples of `ROWS` vectors of `WIDTH` features and a regression target of `OUT` features per vector."""

    def __init__(self, n: int = 32, seed: int = 5) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, ROWS, WIDTH, generator=g)
        self.y = torch.randn(n, ROWS, OUT, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


class MLP(L.LightningModule):
    """Four hidden Linear layers (32 -> 64 -> 32 -> 64 -> 32) and an output layer (32 -> 16), fp32, SGD."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)
        self.fc3, self.fc4 = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)
        self.head = nn.Linear(WIDTH, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.fc2(F.gelu(self.fc1(x)))
        x = x + self.fc4(F.gelu(self.fc3(x)))
        return self.head(x)

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(self(batch["x"]), batch["y"])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def emulated(recipe: str) -> Any:
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)


def converted(recipe: str | None, nudge: float = 0.0) -> MLP:
    """The MLP with the same torchao conversion as the strategy's (every hidden Linear; the output layer kept), or
    plain (`recipe=None`); `nudge` moves every initial parameter one float32 step towards it (the noise floor)."""
    module = MLP()
    if nudge:
        with torch.no_grad():
            for parameter in module.parameters():
                parameter.copy_(torch.nextafter(parameter, torch.full_like(parameter, nudge)))
    if recipe is not None:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(module, module_filter_fn=lambda m, fqn: fqn in CONVERTED, config=emulated(recipe))
    return module


def rank_batches(data: Dataset, dp: int) -> list[list[Any]]:
    """Per step, each data-parallel rank's batch as Lightning's distributed sampler feeds it."""
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    samplers = [list(DistributedSampler(data, num_replicas=dp, rank=r, shuffle=True, seed=seed)) for r in range(dp)]
    return [
        [default_collate([data[i] for i in samplers[r][s * BATCH : (s + 1) * BATCH]]) for r in range(dp)]
        for s in range(STEPS)
    ]


def reference_on(
    make: Callable[[], MLP], steps: list[list[Any]], clip_norm: float | None = None
) -> dict[str, torch.Tensor]:
    """One process on `steps`: per optimizer step, the batches the ranks (and their micro-batches) each put through
    the model alone (each with its own activation scales), the losses averaged as the gradients are, the gradients
    clipped to `clip_norm` (if given) before the step."""
    module = make()
    optimizer = module.configure_optimizers()
    for batches in steps:
        optimizer.zero_grad()
        (sum(module.loss(b) for b in batches) / len(batches)).backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip_norm)
        optimizer.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def against_one_process(
    got: dict[str, torch.Tensor], recipe: str, steps: list[list[Any]], clip_norm: float | None = None
) -> dict[str, float]:
    """`got` (the parameters a run ended with) against one process with the same conversion on the same `steps`
    (`reference_on`): the largest difference; float8's noise floor there (the same run started one float32 step
    away from each initial parameter, each way); and how far float8 moved that run from high precision (so a run that
    silently trained in high precision fails)."""
    want = reference_on(lambda: converted(recipe), steps, clip_norm)
    nudged = [reference_on(lambda n=n: converted(recipe, n), steps, clip_norm) for n in (float("inf"), float("-inf"))]
    return {
        "max_abs_diff": max_diff(got, want),
        "noise_floor": max(max_diff(run, want) for run in nudged),
        "float8_effect": max_diff(reference_on(lambda: converted(None), steps, clip_norm), want),
    }


def parity(make_strategy: Callable[[], Any], recipe: str, dp: int, empty_init: bool = False) -> dict | None:
    """Train under the strategy (the model built on the meta device with `empty_init`: converted there, then each
    rank's shards initialised); on rank 0 the largest parameter difference to one process with the same
    conversion, the noise floor of that one process (the same run started one float32 step away, each way), and
    how far float8 moves the run from high precision (so a run that silently trained in high precision fails)."""
    trainer = trainer_for(make_strategy())
    data = Vectors()
    with trainer.init_module(empty_init=empty_init):
        module = MLP()
    trainer.fit(module, DataLoader(data, batch_size=BATCH))
    got = full_params(trainer)
    from lightning_dpar.float8 import converted_modules

    modules = converted_modules(trainer.lightning_module)
    gathered: list[Any] = [None] * world_size()
    torch.distributed.all_gather_object(gathered, modules)
    if trainer.global_rank != 0:
        return None
    return {
        **against_one_process(got, recipe, rank_batches(data, dp)),
        "converted": gathered,
        "plan": list(trainer.strategy.plan.float8),
        "dims": trainer.strategy.dims.describe(),
    }


def fsdp(recipe: str, **options: Any) -> Callable[[], Any]:
    return lambda: FullyShardStrategy(float8=emulated(recipe), **options)


def tp(recipe: str, **options: Any) -> Callable[[], Any]:
    return lambda: FSDPTensorParallelStrategy(
        tensor_parallel_size=2, tp_plan=TP_PLAN, float8=emulated(recipe), **options
    )


def fabric_tp(recipe: str) -> Any:
    return dpar_fabric.FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=TP_PLAN, float8=emulated(recipe))


def expect_error(make_strategy: Callable[[], Any]) -> list[Any]:
    """Every rank's error (type and message), gathered on every rank: each must raise alike, none may hang."""
    message = None
    try:
        trainer_for(make_strategy()).fit(MLP(), DataLoader(Vectors(), batch_size=BATCH))
    except Exception as err:
        message = f"{type(err).__name__}: {err}"
    messages: list[Any] = [None] * world_size()
    torch.distributed.all_gather_object(messages, message)
    return messages


class HandTensorwiseTP(MLP):
    """What `float8='tensorwise'` under TP would be, written by hand as torchtitan writes it: the model converted with
    torchao, then torchao's float8 styles in `configure_model` (adopted by `dpar_2d`, which adds FSDP)."""

    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import parallelize_module
        from torchao.float8 import convert_to_float8_training
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

        if type(self.fc1) is not nn.Linear:
            return
        config = emulated("tensorwise")
        convert_to_float8_training(self, module_filter_fn=lambda m, fqn: fqn in CONVERTED, config=config)
        colwise, rowwise = Float8ColwiseParallel(), Float8RowwiseParallel()
        styles = {"fc1": colwise, "fc2": rowwise, "fc3": colwise, "fc4": rowwise}
        parallelize_module(self, self.device_mesh["tensor_parallel"], styles)


def tensorwise_tp_by_hand() -> dict | None:
    """The difference from one process of tensorwise under TP 2 with torchao's float8 styles (what the refusal of
    `float8='tensorwise'` under TP quotes), beside the noise floor."""
    trainer = trainer_for(FSDPTensorParallelStrategy(tensor_parallel_size=2))
    data = Vectors()
    trainer.fit(HandTensorwiseTP(), DataLoader(data, batch_size=BATCH))
    got = full_params(trainer)
    if trainer.global_rank != 0:
        return None
    return against_one_process(got, "tensorwise", rank_batches(data, 1))


#: Micro-batches per optimizer step in the Fabric loop (all but the last inside `fabric.no_backward_sync`).
FABRIC_ACCUMULATE = 2
#: The Fabric loop's gradient-norm clipping (the test checks it clipped).
CLIP_NORM = 0.5


def fabric_parity(strategy: Any, recipe: str, dp: int) -> dict | None:
    """float8 in a user's own loop: `fabric.init_module(empty_init=True)` (converted on the meta device, each rank's
    shards initialised), `fabric.setup`, `FABRIC_ACCUMULATE` micro-batches per step with `fabric.no_backward_sync`,
    `fabric.backward`, `fabric.clip_gradients`, against one process running the same torchao conversion on each
    data-parallel rank's micro-batches alone; the noise floor and float8's effect as in `parity`."""
    from lightning.fabric import Fabric

    from lightning_dpar.float8 import converted_modules
    from tests.workers.fabric import gathered

    fabric = Fabric(accelerator="cpu", devices=world_size(), strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        module = MLP()
    model = fabric.setup(module)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    rank = fabric.strategy.distributed_sampler_kwargs["rank"]
    per_step = dp * FABRIC_ACCUMULATE * BATCH  # a global batch: every (micro-batch, rank) batch, in that order
    data = Vectors(n=STEPS * per_step)
    steps = [[data[i : i + BATCH] for i in range(s * per_step, (s + 1) * per_step, BATCH)] for s in range(STEPS)]
    clipped = []
    for batches in steps:
        for micro in range(FABRIC_ACCUMULATE):
            batch = batches[micro * dp + rank]
            with fabric.no_backward_sync(model, enabled=micro < FABRIC_ACCUMULATE - 1):
                fabric.backward(F.mse_loss(model(batch["x"]), batch["y"]) / FABRIC_ACCUMULATE)
        clipped.append(fabric.clip_gradients(model, optimizer, max_norm=CLIP_NORM).item() > CLIP_NORM)
        optimizer.step()
        optimizer.zero_grad()
    got = gathered(model)
    modules: list[Any] = [None] * world_size()
    torch.distributed.all_gather_object(modules, converted_modules(module))
    if fabric.global_rank != 0:
        return None
    return {
        **against_one_process(got, recipe, steps, CLIP_NORM),
        "converted": modules,
        "clipped": any(clipped),
    }


def checkpoint_into_high_precision() -> dict | None:
    """A float8 run (FSDP 2, rowwise) saves a sharded checkpoint; a run without float8 (same layout) resumes from it:
    the same keys, the same values (float8 changes the matmuls, not the parameters' precision)."""
    from tests.workers.checkpoint_common import case_dir

    root = case_dir("float8_checkpoint")
    trainer = trainer_for(fsdp("rowwise")())
    trainer.fit(MLP(), DataLoader(Vectors(), batch_size=BATCH))
    trainer.save_checkpoint(root / "float8.ckpt")
    saved = full_params(trainer)
    plain = trainer_for(FullyShardStrategy())
    plain.fit(MLP(), DataLoader(Vectors(), batch_size=BATCH), ckpt_path=str(root / "float8.ckpt"))  # at max_steps
    loaded = full_params(plain)
    if plain.global_rank != 0:
        return None
    return {
        "keys_equal": sorted(saved) == sorted(loaded) == sorted(MLP().state_dict()),
        "max_abs_diff": max_diff(saved, loaded),
    }


def group_float8() -> Iterator[Case]:
    world = world_size()
    if world == 2:
        for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
            yield Case(f"float8_fsdp2_{recipe}", lambda r=recipe: parity(fsdp(r), r, 2))
        yield Case("float8_fsdp2_rowwise_meta_init", lambda: parity(fsdp("rowwise"), "rowwise", 2, empty_init=True))
        compiled = fsdp("rowwise", shard_modules=["fc*"], compile={"backend": "aot_eager"})  # each Linear compiled
        yield Case("float8_fsdp2_rowwise_compiled", lambda: parity(compiled, "rowwise", 2))
        for recipe in ("rowwise", "rowwise_with_gw_hp"):
            yield Case(f"float8_tp2_{recipe}", lambda r=recipe: parity(tp(r), r, 1))
        yield Case("float8_checkpoint_into_high_precision", checkpoint_into_high_precision)
        for recipe in ("tensorwise", "rowwise"):
            yield Case(
                f"float8_fabric_fsdp2_{recipe}",
                lambda r=recipe: fabric_parity(dpar_fabric.FullyShardStrategy(float8=emulated(r)), r, 2),
            )
        yield Case("float8_fabric_tp2_rowwise", lambda: fabric_parity(fabric_tp("rowwise"), "rowwise", 1))
        yield Case("float8_tensorwise_tp_by_hand", tensorwise_tp_by_hand)
        yield Case("float8_error_tensorwise_tp", lambda: expect_error(tp("tensorwise")))
        yield Case(
            "float8_error_cpu_without_emulate", lambda: expect_error(lambda: FullyShardStrategy(float8="rowwise"))
        )
    if world == 4:
        for recipe in ("rowwise", "rowwise_with_gw_hp"):
            yield Case(f"float8_tp2_fsdp2_{recipe}", lambda r=recipe: parity(tp(r), r, 2))
        yield Case("float8_fabric_tp2_fsdp2_rowwise", lambda: fabric_parity(fabric_tp("rowwise"), "rowwise", 2))
        yield Case(
            "float8_error_pipeline",
            lambda: expect_error(tp("rowwise", pipeline_parallel_size=2, shard_modules=["fc*"])),
        )


GROUPS = {"float8": group_float8}
