"""Optimizers whose update is not elementwise, through real Trainers (`tests/launched/test_optimizers.py`): each trains
exactly as under Lightning's DDP on the same global batches, or is refused on every rank before the first step."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, ReplicateStrategy
from tests.support.models import IN_DIM, Net, ParityModule, RegressionData, global_batches, loader
from tests.workers.cases import Case
from tests.workers.checkpoint_common import case_dir
from tests.workers.common import BATCH, STEPS, full_params, trainer_for, world_size
from tests.workers.pipeline_common import data_parallel, pipeline_strategy, whole_model

#: Column- then row-wise, as a user would shard the MLP's two matrices.
MLP_TP_PLAN = {"model.fc1": "colwise", "model.fc2": "rowwise"}


#: Matrix shapes (input, hidden, output) of the MLP: its two weights are `hidden x input` and `output x hidden`.
SHAPES: dict[str, tuple[int, int, int]] = {
    "small": (IN_DIM, 12, 5),  # tall then wide, 12 and 5 rows shard unevenly under FSDP
    "tall_wide": (32, 64, 32),  # the issue's: 64 x 32 then 32 x 64, whose TP shards are square
    "wide_tall": (64, 32, 64),  # 32 x 64 then 64 x 32
    "square": (16, 16, 16),
    "odd": (7, 14, 9),  # odd sizes where TP 2 does not split (it must divide 14), split unevenly by FSDP 2
    "odd_rows": (7, 13, 9),  # 13 rows, then 13 columns: uneven FSDP shards (TP 2 refuses 13, by name)
}


class MLP(nn.Module):
    """Two matrices and no biases (Muon takes 2D parameters only)."""

    def __init__(self, shape: tuple[int, int, int] = SHAPES["small"]) -> None:
        super().__init__()
        self.fc1 = nn.Linear(shape[0], shape[1], bias=False)
        self.fc2 = nn.Linear(shape[1], shape[2], bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


class ShapedData(RegressionData):
    """`RegressionData` with `x` and `y` as wide as the MLP's input and output."""

    def __init__(self, shape: tuple[int, int, int] = SHAPES["small"], n: int = 128) -> None:
        super().__init__(n)
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, shape[0], generator=g)
        self.y = torch.randn(n, shape[2], generator=g)


class LARSLike(torch.optim.Optimizer):
    """A user's layer-wise adaptive optimizer, unknown to the package: SGD scaled by ||w|| / ||g|| per tensor."""

    def __init__(self, params, lr: float = 0.1, trust: float = 0.02) -> None:
        super().__init__(params, {"lr": lr, "trust": trust})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    ratio = group["trust"] * p.norm() / (p.grad.norm() + 1e-9)
                    p.sub_(group["lr"] * ratio * p.grad)
        return loss


class LocalLARS(LARSLike):
    """`LARSLike` computing its norms on each rank's shard (`to_local()`): not exact on shards, and not elementwise."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    w, g = (p.to_local(), p.grad.to_local()) if isinstance(p, DTensor) else (p, p.grad)
                    w.sub_(group["lr"] * group["trust"] * w.norm() / (g.norm() + 1e-9) * g)


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "muon": lambda params: torch.optim.Muon(params, lr=0.02),
    "adafactor": lambda params: torch.optim.Adafactor(params, lr=0.01),
    "lars": lambda params: LARSLike(params),
    "local_lars": lambda params: LocalLARS(params),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01),
}


class MLPModule(L.LightningModule):
    def __init__(self, optimizer: str, shape: str = "small") -> None:
        super().__init__()
        self.optimizer_name = optimizer
        torch.manual_seed(0)
        self.model = MLP(SHAPES[shape])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        return OPTIMIZERS[self.optimizer_name](self.parameters())


def fit(strategy: Any, optimizer: str, shape: str = "small", callbacks=()) -> dict[str, torch.Tensor] | None:
    """Train 3 steps; the full parameters on rank 0 (None elsewhere)."""
    trainer = trainer_for(strategy, callbacks=list(callbacks))
    trainer.fit(MLPModule(optimizer, shape), loader(ShapedData(SHAPES[shape]), BATCH))
    got = full_params(trainer)
    return {k: v.clone() for k, v in got.items()} if trainer.global_rank == 0 else None


@functools.cache
def ddp_reference(optimizer: str, shape: str = "small") -> dict[str, torch.Tensor] | None:
    """Lightning's own DDP on the same ranks and global batches: the ground truth."""
    return fit("ddp", optimizer, shape)


def one_process_reference(optimizer: str, dp: int, shape: str = "small") -> dict[str, torch.Tensor]:
    """Training in this process on the global batches of `dp` data-parallel ranks (for layouts whose data-parallel
    size is not the world's, which Lightning's DDP cannot match)."""
    module = MLPModule(optimizer, shape)
    opt = module.configure_optimizers()
    for x, y in global_batches(ShapedData(SHAPES[shape]), dp, BATCH, STEPS):
        opt.zero_grad()
        F.mse_loss(module.model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def parity_with_ddp(
    strategy: Callable[[], Any], optimizer: str, dp: int | None = None, shape: str = "small"
) -> dict[str, float] | None:
    """The largest difference to DDP (or, with `dp`, to one process) on the same global batches."""
    want = ddp_reference(optimizer, shape) if dp is None else one_process_reference(optimizer, dp, shape)
    got = fit(strategy(), optimizer, shape)
    if got is None or want is None:
        return None
    return _differences(got, want, MLPModule(optimizer, shape).state_dict())


def _differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], start: dict[str, torch.Tensor]):
    return {
        "max_abs_diff": max((got[k] - want[k]).abs().max().item() for k in want),
        "moved": max((want[k] - start[k]).abs().max().item() for k in want),
    }


class MuonOnTheSameGradients(Callback):
    """torch's own `Muon`, on whole copies of the parameters on every rank, stepped on the gradients the strategy's
    run computed (gathered whole before each step): what DDP's Muon would do with these gradients, isolated from the
    order in which the layout summed them (which Muon's bfloat16 Newton-Schulz can magnify)."""

    def __init__(self, shape: str) -> None:
        self.shadow = MLPModule("muon", shape)
        self.optimizer = self.shadow.configure_optimizers()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        mine = dict(self.shadow.named_parameters())
        for name, param in pl_module.named_parameters():  # a collective per parameter: every rank, same order
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            mine[name].grad = grad.detach().cpu().clone()
        self.optimizer.step()


def muon_on_same_gradients(strategy: Callable[[], Any], shape: str, dp: int | None = None) -> dict[str, float] | None:
    """The strategy's Muon against torch's Muon stepped on the same gradients (`max_abs_diff`, expected 0: the
    same arithmetic on the same whole matrices), and, for the record, against DDP or one process
    (`end_to_end_diff`), where gradients summed in another order may round differently."""
    same = MuonOnTheSameGradients(shape)
    got = fit(strategy(), "muon", shape, callbacks=[same])
    want = ddp_reference("muon", shape) if dp is None else one_process_reference("muon", dp, shape)
    if got is None or want is None:
        return None
    shadow = {k: v.detach() for k, v in same.shadow.state_dict().items()}
    start = MLPModule("muon", shape).state_dict()
    return {
        "max_abs_diff": _differences(got, shadow, start)["max_abs_diff"],
        "end_to_end_diff": _differences(got, want, start)["max_abs_diff"],
        "moved": _differences(got, want, start)["moved"],
    }


def resumes_exactly(strategy: Callable[[], Any], optimizer: str) -> dict[str, float] | None:
    """3 steps saving at step 2, then a new Trainer resuming there for the 3rd: the same parameters, bit for bit?"""
    root = case_dir(f"resume_{optimizer}")
    every = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    continuous = trainer_for(strategy(), enable_checkpointing=True, callbacks=[every])
    continuous.fit(MLPModule(optimizer), loader(RegressionData(), BATCH))
    want = full_params(continuous)
    resumed = trainer_for(strategy())
    resumed.fit(MLPModule(optimizer), loader(RegressionData(), BATCH), ckpt_path=str(root / "step=2.ckpt"))
    got = full_params(resumed)
    if resumed.global_rank != 0:
        return None
    return {"max_abs_diff": max((want[k] - got[k]).abs().max().item() for k in want)}


def refused(strategy: Callable[[], Any], optimizer: str, shape: str = "small") -> dict[str, Any]:
    """The error each rank raised (every rank must raise), and whether any step ran first."""
    trainer = trainer_for(strategy())
    module = MLPModule(optimizer, shape)
    try:
        trainer.fit(module, loader(ShapedData(SHAPES[shape]), BATCH))
    except Exception as error:  # the case records each rank's message; a rank that does not raise fails it
        return {"type": type(error).__name__, "message": str(error), "global_step": trainer.global_step}
    raise AssertionError(f"{optimizer} trained under {trainer.strategy} instead of being refused")


def gathered(value: dict[str, Any]) -> list[dict[str, Any]]:
    """`value` from every rank, on rank 0 (the launch's process group is up once a Trainer ran)."""
    import torch.distributed as dist

    values: list[Any] = [None] * world_size()
    dist.all_gather_object(values, value)
    return values


def fsdp() -> str:
    return "dpar_fsdp"


def tensor_parallel() -> FSDPTensorParallelStrategy:
    return FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=MLP_TP_PLAN)


def replicate() -> ReplicateStrategy:
    return ReplicateStrategy()


#: The shapes Muon is checked on under every layout (`SHAPES`; "small" is the parity cases' own).
MUON_SHAPES = ("tall_wide", "wide_tall", "square", "odd")


def group_optimizers() -> Iterator[Case]:
    yield Case("replicate_adafactor", lambda: parity_with_ddp(replicate, "adafactor"))
    yield Case("replicate_lars", lambda: parity_with_ddp(replicate, "lars"))
    yield Case("fsdp_adamw_vs_ddp", lambda: parity_with_ddp(fsdp, "adamw"))
    yield Case("fsdp_muon", lambda: parity_with_ddp(fsdp, "muon"))
    yield Case("tp_muon", lambda: parity_with_ddp(tensor_parallel, "muon", dp=world_size() // 2))
    yield Case("tp_adamw", lambda: parity_with_ddp(tensor_parallel, "adamw", dp=world_size() // 2))
    yield Case("tp_muon_resume", lambda: resumes_exactly(tensor_parallel, "muon"))
    yield Case("fsdp_adafactor", lambda: gathered(refused(fsdp, "adafactor")))
    yield Case("tp_adafactor", lambda: gathered(refused(tensor_parallel, "adafactor")))
    # A LARS written with DTensor-propagated norms is exact on shards; one reading its shards as plain tensors is not.
    yield Case("fsdp_lars", lambda: parity_with_ddp(fsdp, "lars"))
    yield Case("tp_lars", lambda: parity_with_ddp(tensor_parallel, "lars", dp=world_size() // 2))
    yield Case("fsdp_local_lars", lambda: gathered(refused(fsdp, "local_lars")))
    yield Case("tp_local_lars", lambda: gathered(refused(tensor_parallel, "local_lars")))
    for shape in MUON_SHAPES:
        yield Case(f"fsdp_muon_{shape}", functools.partial(muon_on_same_gradients, fsdp, shape))
        yield Case(f"tp_muon_{shape}", functools.partial(muon_on_same_gradients, tensor_parallel, shape, 1))
    yield Case("fsdp_muon_odd_rows", functools.partial(muon_on_same_gradients, fsdp, "odd_rows"))
    yield Case("tp_muon_odd_rows", lambda: gathered(refused(tensor_parallel, "muon", "odd_rows")))


def hsdp() -> FullyShardStrategy:
    return FullyShardStrategy(replicate_size=2)


class PipelinedModule(ParityModule):
    """The pipeline cases' model (`Net`, split into 2 stages) with one of `OPTIMIZERS`."""

    def configure_optimizers(self):
        return OPTIMIZERS[self.hparams.optimizer](self.parameters())


def pipelined(optimizer: str) -> dict[str, float] | list[dict[str, Any]] | None:
    """PP 2 x FSDP 2 (each stage's shard probe on its own mesh, the verdicts shared by all 4 ranks): the largest
    difference to one process on the same global batches, or every rank's error."""
    trainer = trainer_for(pipeline_strategy("1F1B", 1))
    try:
        trainer.fit(PipelinedModule(optimizer=optimizer), loader(RegressionData(), BATCH))
    except Exception as error:  # every rank must raise, alike
        return gathered({"type": type(error).__name__, "message": str(error), "global_step": trainer.global_step})
    got = whole_model(trainer)
    torch.manual_seed(0)
    model = Net()
    reference = OPTIMIZERS[optimizer](model.parameters())
    for x, y in global_batches(RegressionData(), data_parallel(), BATCH, STEPS):
        reference.zero_grad()
        F.mse_loss(model(x), y).backward()
        reference.step()
    want = {f"model.{k}": v.detach() for k, v in model.state_dict().items()}
    start = PipelinedModule(optimizer=optimizer).state_dict()
    return _differences(got, want, start) if trainer.global_rank == 0 else None


def group_optimizers4() -> Iterator[Case]:
    """Meshes of two dims of size 2: the update travels along both (`distributed_muon._broadcast_from`)."""
    yield Case("hsdp_muon", lambda: parity_with_ddp(hsdp, "muon"))
    yield Case("2d_muon", lambda: parity_with_ddp(tensor_parallel, "muon", dp=world_size() // 2))
    yield Case("hsdp_lars", lambda: parity_with_ddp(hsdp, "lars"))
    yield Case("2d_lars", lambda: parity_with_ddp(tensor_parallel, "lars", dp=world_size() // 2))
    yield Case("2d_local_lars", lambda: gathered(refused(tensor_parallel, "local_lars")))
    yield Case("pp_fsdp_lars", lambda: pipelined("lars"))
    yield Case("pp_fsdp_local_lars", lambda: pipelined("local_lars"))
    for shape in MUON_SHAPES:
        yield Case(f"hsdp_muon_{shape}", functools.partial(muon_on_same_gradients, hsdp, shape))
        yield Case(f"2d_muon_{shape}", functools.partial(muon_on_same_gradients, tensor_parallel, shape, 2))
    yield Case("hsdp_muon_odd_rows", functools.partial(muon_on_same_gradients, hsdp, "odd_rows"))
    yield Case("2d_muon_odd_rows", lambda: gathered(refused(tensor_parallel, "muon", "odd_rows")))


GROUPS = {"optimizers": group_optimizers, "optimizers4": group_optimizers4}
