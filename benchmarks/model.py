"""The benchmark model and data: a stack of residual MLP blocks over token sequences (transformer-shaped, so the
blocks are the FSDP units and `fc1`/`fc2` split column/row-wise for tensor parallelism)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


@dataclass(frozen=True)
class Size:
    dim: int
    hidden: int
    depth: int
    seq: int
    batch: int  # per data-parallel rank

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


#: CPU: sized so a step takes ~0.1 s on a shared 2-core machine. GPU: ~270 M parameters, fp32 with TF32 matmuls.
SIZES = {
    "cpu": Size(dim=256, hidden=1024, depth=4, seq=16, batch=8),
    "cuda": Size(dim=2048, hidden=8192, depth=8, seq=1024, batch=8),
}

#: The tensor-parallel plan, relative to the LightningModule (its `model` attribute holds the `Net`).
TP_PLAN = {"model.layers.*.fc1": "colwise", "model.layers.*.fc2": "rowwise"}


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(size.dim, size.hidden) for _ in range(size.depth))
        self.out = nn.Linear(size.dim, size.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def build_net(size: Size, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net(size)


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


class SyntheticTokens(Dataset):
    """`n` samples of random `[seq, dim]` inputs and targets (embeddings already applied). Only `pool` distinct
    samples are stored and repeated, so GPU-sized runs do not hold gigabytes of data in every process."""

    def __init__(self, size: Size, n: int, pool: int = 32, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.n = n
        self.x = torch.randn(min(n, pool), size.seq, size.dim, generator=g)
        self.y = torch.randn(min(n, pool), size.seq, size.dim, generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i % len(self.x)], self.y[i % len(self.x)]


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


class BenchModule(L.LightningModule):
    """The LightningModule every Lightning-driven variant trains (the same `Net`, loss and optimizer)."""

    def __init__(self, size: Size) -> None:
        super().__init__()
        self.model = build_net(size)

    def training_step(self, batch, batch_idx):
        return loss_fn(self.model, batch)

    def configure_optimizers(self):
        return make_optimizer(self.parameters())


class HandParallelModule(BenchModule):
    """For Lightning's `ModelParallelStrategy`: the same TP plan and FSDP units, written by hand in
    `configure_model` as that strategy's docs show."""

    def configure_model(self):
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if isinstance(self.model, FSDPModule):
            return
        tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        for layer in self.model.layers:
            if tp_mesh.size() > 1:
                parallelize_module(layer, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(self.model, mesh=dp_mesh)
