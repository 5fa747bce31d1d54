"""Models and data shared by the tests: small, deterministic, and shaped like the models of torch's own tests
(`test/distributed/tensor/parallel/test_fsdp_2d_parallel.py` and `test_parallelize_api.py`)."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

IN_DIM = 5


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.relu(self.fc1(x)))


class Net(nn.Module):
    """Transformer-like stack `inp -> layers[*] -> out` with the uneven dims of torch's `test_fsdp_2d_parallel.py`: 15
    and 5 divide by neither the FSDP nor the TP size; the hidden size 12 is what column/row-wise TP splits (as torch
    requires)."""

    def __init__(self, dim: int = 15, hidden: int = 12, depth: int = 2, out_dim: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(IN_DIM, dim)
        self.layers = nn.ModuleList(Block(dim, hidden) for _ in range(depth))
        self.out = nn.Linear(dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.inp(x))
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


#: Colwise then rowwise inside each block (as in torch's `test_parallelize_api.py`), with a wildcard pattern.
TP_PLAN = {"model.layers.*.fc1": "colwise", "model.layers.*.fc2": "rowwise"}


class RegressionData(Dataset):
    def __init__(self, n: int = 128, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, IN_DIM, generator=g)
        self.y = torch.randn(n, 5, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=False)
    if name == "sgd_foreach":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=True)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    raise ValueError(name)


class RegressionModule(L.LightningModule):
    """The steps the test models share: mean squared error on `(x, y)` batches, logged over the data-parallel ranks."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)


class ParityModule(RegressionModule):
    def __init__(self, optimizer: str = "sgd", depth: int = 2, empty_init_check: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.model = Net(depth=depth)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def configure_optimizers(self):
        return make_optimizer(self.hparams.optimizer, self.parameters())


class SharedLayer(nn.Module):
    """A block of its own (a norm) around a module shared with the other layers."""

    def __init__(self, shared: nn.Module, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ffn = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn(self.norm(x))


class SharedBody(nn.Module):
    """Cross-layer weight sharing (ALBERT, recurrent-depth models): every layer calls one `Block`."""

    def __init__(self, dim: int = 15, hidden: int = 12, depth: int = 3) -> None:
        super().__init__()
        shared = Block(dim, hidden)
        self.layers = nn.ModuleList(SharedLayer(shared, dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class SharedWeightsModule(L.LightningModule):
    """Parameters used by several FSDP units: the body's layers share one block (its owner is the body), and the
    top-level `last` is tied to the top-level `first` (their owner is the LightningModule), unless `tie_top_level`
    is off (DDP refuses a parameter shared by two top-level modules)."""

    def __init__(self, dim: int = 15, tie_top_level: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(IN_DIM, dim)
        self.first = nn.Linear(dim, dim)
        self.body = SharedBody(dim)
        self.last = nn.Linear(dim, dim)
        if tie_top_level:
            self.last.weight = self.first.weight
        self.out = nn.Linear(dim, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.last(self.body(self.first(F.relu(self.inp(x))))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def reference_train(
    optimizer: str,
    global_batches: list[tuple[torch.Tensor, torch.Tensor]],
    depth: int = 2,
    clip_norm: float | None = None,
    clip_value: float | None = None,
) -> dict[str, torch.Tensor]:
    """Single-process training on the same global batches: the ground truth for parity tests."""
    torch.manual_seed(0)
    model = Net(depth=depth)
    opt = make_optimizer(optimizer, model.parameters())
    for x, y in global_batches:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        opt.step()
    return {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}


def global_batches(data: RegressionData, dp: int, batch_size: int, steps: int, accumulate: int = 1):
    """What Lightning's sampler feeds `dp` ranks, regrouped into one batch per optimizer step.

    Lightning always shuffles training data with `DistributedSampler(shuffle=True, seed=0)` for distributed
    strategies; the reference replays exactly those indices.
    """
    per_rank = [list(DistributedSampler(data, num_replicas=dp, rank=r, shuffle=True, seed=0)) for r in range(dp)]
    micro = batch_size
    batches = []
    for step in range(steps):
        idx = [i for r in range(dp) for i in per_rank[r][step * micro * accumulate : (step + 1) * micro * accumulate]]
        batches.append((data.x[idx], data.y[idx]))
    return batches


def loader(data: Dataset, batch_size: int) -> DataLoader:
    return DataLoader(data, batch_size=batch_size, shuffle=False)


class ConformanceNet(Net):
    """`Net` with a `BatchNorm1d` after the input layer (or none): a model with buffers that change in training."""

    def __init__(self, batchnorm: bool = True) -> None:
        super().__init__(dim=16)
        self.norm = nn.BatchNorm1d(16) if batchnorm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm(self.inp(x)))
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


class ConformanceModule(RegressionModule):
    """The Lightning conformance matrix's model (`tests/support/conformance_harness.py`)."""

    tp_plan = TP_PLAN

    def __init__(self, batchnorm: bool = True, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        torch.manual_seed(0)
        self.model = ConformanceNet(batchnorm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
