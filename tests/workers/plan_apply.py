"""Ordinary LightningModules through every strategy: blocks in a top-level `nn.ModuleList` / `nn.ModuleDict` (no
wrapper on the container), row-wise sharded token embeddings, and a unit bypassed by the model (refused under DDP,
never a silent divergence). Each parity case ends with the same parameters as single-process training."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterator

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, ReplicateStrategy
from tests.support.models import IN_DIM, Block, RegressionData, global_batches, loader
from tests.workers.cases import Case, one_case
from tests.workers.common import BATCH, STEPS, full_params, trainer_for, world_size


class TopLevelBlocks(L.LightningModule):
    """Blocks registered on the LightningModule itself: a `ModuleList` of blocks and a `ModuleDict` of heads."""

    tp_plan = {"layers.*.fc1": "colwise", "layers.*.fc2": "rowwise", "heads.out": "colwise_gather_output"}

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(IN_DIM, 16)
        self.layers = nn.ModuleList(Block(16, 12) for _ in range(2))
        self.heads = nn.ModuleDict({"out": nn.Linear(16, 6)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.inp(x))
        for layer in self.layers:
            x = layer(x)
        return self.heads["out"](x)[:, :5]

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class DirectParameters(TopLevelBlocks):
    """Parameters registered on the LightningModule itself, used in `training_step` (outside `forward`)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((5,), 0.5))
        self.shift = nn.Parameter(torch.zeros(5))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x) * self.scale + self.shift, y)


class TokenData(Dataset):
    def __init__(self, n: int = 128, vocab: int = 16, length: int = 6, seed: int = 7) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, vocab, (n, length), generator=g)
        self.y = torch.randn(n, 5, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class EmbeddingModel(L.LightningModule):
    """Token embedding sharded row-wise (vocabulary rows), the ids kept whole, as torchtitan shards it."""

    tp_plan = {"net.emb": "rowwise", "net.fc": "colwise", "net.proj": "rowwise"}

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.ModuleDict({"emb": nn.Embedding(16, 8), "fc": nn.Linear(8, 12), "proj": nn.Linear(12, 5)})
        self.net.forward = self._net_forward  # the unit is called through its forward

    def _net_forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.net["emb"](ids)
        return self.net["proj"](F.relu(self.net["fc"](h))).mean(dim=1)

    def training_step(self, batch, batch_idx):
        ids, y = batch
        return F.mse_loss(self.net(ids), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _reference(make_module, data, dp: int) -> dict[str, torch.Tensor]:
    module = make_module()
    optimizer = module.configure_optimizers()
    for x, y in global_batches(data, dp, BATCH, STEPS):
        optimizer.zero_grad()
        module.training_step((x, y), 0).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def parity_case(make_module, strategy, dp: int, data: Dataset) -> dict | None:
    """Train under `strategy`; on rank 0, the largest difference to single-process training on the same batches."""
    module = make_module()
    trainer = trainer_for(strategy)
    trainer.fit(module, loader(data, BATCH))
    got = full_params(trainer)
    if trainer.global_rank != 0:
        return None
    want = _reference(make_module, data, dp)
    assert set(got) == set(want), (sorted(got), sorted(want))
    return {"max_abs_diff": max((got[k] - want[k]).abs().max().item() for k in want)}


def group_ordinary() -> Iterator[Case]:
    world = world_size()
    tp = 2 if world % 2 == 0 else 1
    for name, make_module in (("top_level_blocks", TopLevelBlocks), ("direct_parameters", DirectParameters)):
        yield Case(
            f"{name}_replicate",
            lambda make_module=make_module: parity_case(make_module, ReplicateStrategy(), world, RegressionData()),
        )
        yield Case(
            f"{name}_fsdp",
            lambda make_module=make_module: parity_case(make_module, FullyShardStrategy(), world, RegressionData()),
        )
        yield Case(
            f"{name}_2d",
            lambda make_module=make_module: parity_case(
                make_module, FSDPTensorParallelStrategy(tensor_parallel_size=tp), world // tp, RegressionData()
            ),
        )
    yield Case(
        "direct_parameters_replicate_tp",
        lambda: parity_case(
            DirectParameters,
            ReplicateStrategy(tensor_parallel_size=tp, tp_plan=DirectParameters.tp_plan),
            world // tp,
            RegressionData(),
        ),
    )
    yield Case(
        "embedding_rowwise_2d",
        lambda: parity_case(
            EmbeddingModel, FSDPTensorParallelStrategy(tensor_parallel_size=tp), world // tp, TokenData()
        ),
    )
    yield Case(
        "embedding_rowwise_replicate_tp",
        lambda: parity_case(
            EmbeddingModel,
            ReplicateStrategy(tensor_parallel_size=tp, tp_plan=EmbeddingModel.tp_plan),
            world // tp,
            TokenData(),
        ),
    )


class BypassesItsUnit(TopLevelBlocks):
    """Holds its blocks inside `self.body`, but calls them directly: `body`'s own `forward` never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*self.layers)
        del self.layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.inp(x))
        for block in self.body:
            x = block(x)
        return self.heads["out"](x)[:, :5]


def error_case(strategy, make_module) -> list | None:
    """Fit and expect a refusal; on rank 0, every rank's error message (None where a rank raised nothing)."""
    message = None
    try:
        trainer_for(strategy).fit(make_module(), loader(RegressionData(), BATCH))
    except Exception as err:
        message = f"{type(err).__name__}: {err}"
    messages = [None] * world_size()
    dist.all_gather_object(messages, message)
    return messages if dist.get_rank() == 0 else None


class OddWidths(TopLevelBlocks):
    tp_plan = {"layers.*.fc1": "colwise", "layers.*.fc2": "rowwise"}

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(16, 9) for _ in range(2))


def group_ordinary_errors() -> Iterator[Case]:
    yield Case("bypassed_unit_replicate", lambda: error_case(ReplicateStrategy(), BypassesItsUnit))
    yield Case("tp_does_not_divide", lambda: error_case(FSDPTensorParallelStrategy(tensor_parallel_size=2), OddWidths))
    yield Case("trainers_in_one_process", trainers_in_one_process_case)


def _threads() -> int:
    """This process's threads, native ones included (a gloo process group holds three)."""
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


def trainers_in_one_process_case() -> dict | None:
    """Three Trainers of one layout, one after the other in one process (a sweep, a notebook): the later ones reuse
    the first one's meshes, so the process's process groups and threads stay as they were after the first."""
    threads, meshes = [], []
    for _ in range(3):
        trainer = trainer_for(FSDPTensorParallelStrategy(tensor_parallel_size=2), max_steps=1)
        trainer.fit(TopLevelBlocks(), loader(RegressionData(), BATCH))
        threads.append(_threads())
        meshes.append(trainer.strategy.meshes)
    return {"threads": threads, "same_meshes": all(m is meshes[0] for m in meshes)}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def resume_message_case() -> dict | None:
    """A mid-epoch resume says in one line whether it is exact, and Lightning's "not resumable" warning is gone."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    directory = os.path.join(os.path.dirname(sys.argv[2]), "resume_message")
    data = RegressionData()  # 128 samples / batch 4 / the data-parallel ranks: step 3 is mid-epoch
    checkpoint = ModelCheckpoint(dirpath=directory, every_n_train_steps=3, save_top_k=-1)
    trainer_for("dpar_fsdp", enable_checkpointing=True, callbacks=[checkpoint]).fit(
        TopLevelBlocks(), loader(data, BATCH)
    )
    records = _Records()
    logging.getLogger("lightning.pytorch").addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = trainer_for("dpar_fsdp", max_steps=STEPS + 2)
            trainer.fit(TopLevelBlocks(), loader(data, BATCH), ckpt_path=os.path.join(directory, "epoch=0-step=3.ckpt"))
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(records)
    if trainer.global_rank != 0:
        return None
    return {
        "lightning_warning": [str(w.message) for w in caught if "not resumable" in str(w.message)],
        "resuming_lines": [m for m in records.messages if m.startswith("Resuming")],
    }


GROUPS = {
    "ordinary": group_ordinary,
    "ordinary_errors": group_ordinary_errors,
    "resume_message": one_case("resume_message", resume_message_case),
}
