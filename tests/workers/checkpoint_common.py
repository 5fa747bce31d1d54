"""Helpers shared by the checkpoint workers (`checkpoint.py`, `checkpoint_reshard.py`, `checkpoint_formats.py`,
`checkpoint_faults.py`, `checkpoint_safety.py`): a module whose resume is exact only if everything comes back,
indexed data, loaders, strategies by name, and comparisons of full states.

Where cases save. A case saves under `case_dir(name)`, a directory of its own inside its launch's directory (the
parent of the launch's record directory, a fresh one per fixture): independent cases never share files. A case that
loads what a case of an earlier launch saved gets that directory from its test's fixture, through the environment
(`inputs_env` there, `saved_by` here), so each dependency between launches is written down in one fixture.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.utils.data import DataLoader

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, ReplicateStrategy
from tests.support.models import TP_PLAN, Net, ParityModule, RegressionData
from tests.workers.common import BATCH, world_size

#: The environment variable naming the directories earlier cases saved into: JSON, {case name: directory}.
INPUTS_ENV = "DPAR_CKPT_INPUTS"


def inputs_env(**saved: Path) -> dict[str, str]:
    """The environment of a launch whose cases load what the named cases saved (`saved_by` reads it)."""
    return {INPUTS_ENV: json.dumps({case: str(directory) for case, directory in saved.items()})}


def workdir() -> Path:
    """The launch's directory: the parent of its record directory (`run.py GROUPS OUT`)."""
    return Path(sys.argv[2]).resolve().parent


def case_dir(case: str) -> Path:
    """The directory case `case` saves under (created by the ranks that write into it)."""
    return workdir() / case


def saved_by(case: str, *names: str) -> Path:
    """The file or directory `names` that case `case` of another launch saved, as the test's fixture passed it.

    Missing: that case failed or did not run, and its own test says why; this case fails saying which."""
    given = json.loads(os.environ.get(INPUTS_ENV, "{}"))
    if case not in given:
        raise KeyError(f"no directory given for case {case!r} (only {sorted(given)}): pass it with `inputs_env`")
    path = Path(given[case], *names)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: case {case!r}, which saves it, failed or did not run")
    return path


class IndexedData(RegressionData):
    def __getitem__(self, i: int):
        return self.x[i], self.y[i], torch.tensor(i)


class ReversedSampler(torch.utils.data.Sampler):
    """A custom (non-resumable) sampler: Lightning wraps it in `DistributedSamplerWrapper`."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n


def same_streams(a, b) -> bool:
    """RNG states equal value for value (tensors exactly; tuples and lists alike, as `meta.pt` may read either)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_streams(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_streams(x, y) for x, y in zip(a, b))
    return a == b


class ResumeModule(ParityModule):
    """Adam + a per-step LR schedule + per-rank input noise (RNG): resume is exact only if all of it comes back."""

    def __init__(self, hidden: int = 12, extra_layer: bool = False) -> None:
        super().__init__(optimizer="adam")
        torch.manual_seed(0)
        self.model = Net(hidden=hidden)
        if extra_layer:
            self.extra = torch.nn.Linear(5, 5)
        self.losses: list[tuple[int, float]] = []
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        x = x + 0.1 * torch.randn_like(x)
        loss = F.mse_loss(self(x), y)
        self.losses.append((self.global_step, loss.item()))
        self.seen.extend(index.tolist())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def train_loader(sampler=None) -> DataLoader:
    return DataLoader(IndexedData(), batch_size=BATCH, sampler=sampler)


def val_loader() -> DataLoader:
    return DataLoader(IndexedData(n=16, seed=7), batch_size=BATCH)


def gather(value):
    """`value` of every rank, in rank order (a collective)."""
    values = [None] * world_size()
    dist.all_gather_object(values, value)
    return values


def strategy_for(name: str, **kwargs):
    if name == "fsdp":
        return FullyShardStrategy(**kwargs)
    if name == "replicate":
        return ReplicateStrategy(**kwargs)
    if name == "2d":
        return FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=TP_PLAN, **kwargs)
    raise ValueError(name)


def full_optimizer(trainer: L.Trainer) -> dict:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(trainer.lightning_module, trainer.optimizers[0], options=options)


def flat_tensors(prefix: str, value) -> dict[str, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in flat_tensors(f"{prefix}.{key}", item).items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in flat_tensors(f"{prefix}.{i}", item).items()}
    return {prefix: torch.tensor(float(value))} if isinstance(value, (int, float)) else {}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if set(a) != set(b):
        return float("inf")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def error_of(fn) -> str | None:
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None
